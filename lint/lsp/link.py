"""The language server's one link to trainlint itself: configuration, linting, fixes, docs, --verify.

Everything the server keeps warm between requests lives here: the rule registry (imported once), the
configuration of each folder, and the findings of recent texts, so that a hover, a code action or a
save of unchanged text never lints again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from trainlint.config import (
    Config,
    ConfigError,
    find_config,
    ignored_for_file,
    load_config,
    select_rules,
)
from trainlint.files import is_excluded
from trainlint.fix import FixOutcome, fix_text
from trainlint.incremental import Documents
from trainlint.report import describe_verify, rule_url
from trainlint.results import LintOptions
from trainlint.rule import Finding, registry

__all__ = ["Linter", "Settings", "describe_verify", "explain", "has_probe", "suppressible", "url_of"]

# Texts whose findings are kept: the open documents and the intermediate texts of a fix-all.
_KEPT_RESULTS = 64


@dataclass(frozen=True)
class Settings:
    """What the closest configuration decides for the files below it."""

    config: Config
    rule_ids: tuple[str, ...]
    severity: tuple[tuple[str, str], ...]

    def options(self, path: Path | None) -> LintOptions:
        ids = self.rule_ids
        if path is not None and self.config.per_file_ignores:
            try:
                relative = path.resolve().relative_to(self.config.root).as_posix()
            except ValueError:
                relative = path.as_posix()
            ignored = ignored_for_file(self.config, relative)
            ids = tuple(i for i in ids if not any(i.startswith(p) for p in ignored))
        return LintOptions(ids, self.severity)


def _settings(config_path: Path | None, root: Path) -> Settings:
    config = load_config(config_path) if config_path is not None else Config(root=root)
    ids = select_rules(config.select, config.extend_select, config.ignore)
    severity = tuple(sorted((k, v.value) for k, v in config.severity.items()))
    return Settings(config, tuple(ids), severity)


def _mtime(path: Path | None) -> float:
    try:
        return path.stat().st_mtime if path is not None else 0.0
    except OSError:
        return -1.0


class Linter:
    """Lints document texts with the settings of the configuration closest to each document."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path.cwd()
        registry()  # import every rule now, not on the first keystroke
        self._config_of_folder: dict[Path, Path | None] = {}
        self._settings: dict[Path | None, tuple[float, Settings]] = {}
        self._results: OrderedDict[tuple[str, LintOptions, str], list[Finding]] = OrderedDict()
        # the last parse of each document: an edit re-parses only the statements it touched
        self.documents = Documents()

    def forget_configs(self) -> None:
        """A configuration file was saved or created: look them up again."""
        self._config_of_folder.clear()
        self._settings.clear()

    def forget_results(self) -> None:
        """Another file changed on disk: findings that rest on its facts (cross-file) may change."""
        self._results.clear()

    def settings(self, path: Path | None) -> Settings:
        """The settings for a document (``path`` None: an unsaved one, under the workspace root).
        Raises ``ConfigError`` with the user's message."""
        folder = (path.parent if path is not None else self.root).resolve()
        if folder not in self._config_of_folder:
            self._config_of_folder[folder] = find_config(folder)
        config_path = self._config_of_folder[folder]
        stamp = _mtime(config_path)
        known = self._settings.get(config_path)
        if known is None or known[0] != stamp:
            known = (stamp, _settings(config_path, folder))
            self._settings[config_path] = known
        return known[1]

    def lint(self, text: str, path: Path | None, shown: str) -> list[Finding]:
        """The findings for a text, reported under ``shown``; raises ``ConfigError``. A file its
        configuration excludes gets none, as ``--force-exclude`` does for the file an editor names."""
        settings = self.settings(path)
        if path is not None and is_excluded(
            path.absolute(), settings.config.excludes(), settings.config.root
        ):
            return []
        return self._lint(text, shown, settings.options(path))

    def _lint(self, text: str, shown: str, options: LintOptions) -> list[Finding]:
        key = (shown, options, hashlib.blake2b(text.encode("utf-8", "surrogatepass")).hexdigest())
        found = self._results.get(key)
        if found is None:
            found = self.documents.lint(shown, text, options).findings
            self._results[key] = found
            while len(self._results) > _KEPT_RESULTS:
                self._results.popitem(last=False)
        else:
            self._results.move_to_end(key)
        return found

    def fix_all(self, text: str, path: Path | None, shown: str) -> FixOutcome:
        """The text with every safe fix applied (as ``trainlint --fix``, never unsafe fixes)."""
        options = self.settings(path).options(path)
        return fix_text(text, lambda current: self._lint(current, shown, options), unsafe=False)

    def verify(self, finding: Finding, text: str, path: Path | None) -> Finding:
        """Run ``--verify`` on one finding (imports the verify package, which runs torch in a child)."""
        from trainlint.verify import torch_available, verify_findings

        if not torch_available():
            raise ConfigError('--verify needs PyTorch. Install the extra: pip install "trainlint[verify]"')
        config = self.settings(path).config
        (verified,) = verify_findings(
            [finding], {finding.path: text}, device=config.verify_device, timeout=config.verify_timeout
        )
        return verified


def explain(rule_id: str) -> str | None:
    """A rule's documentation as Markdown (``trainlint --explain``), None for an unknown id."""
    rule = registry().get(rule_id)
    return rule.explain() if rule is not None else None


def suppressible(rule_id: str) -> bool:
    """Whether ``# noqa`` can silence the rule: not the engine's own findings (a file that does not
    parse or cannot be read), which no comment in the file can turn off."""
    rule = registry().get(rule_id)
    return rule is not None and not rule.engine_only


def has_probe(rule_id: str) -> bool:
    rule = registry().get(rule_id)
    return rule is not None and rule.has_probe()


def url_of(finding: Finding) -> str:
    """The documentation page of a finding's rule, as the JSON and SARIF reports give it."""
    return finding.url or rule_url(finding.rule)
