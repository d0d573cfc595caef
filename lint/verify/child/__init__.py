"""The child side of ``--verify``: what runs in the child process that executes probe programs.

The parent never imports the modules of this package (they import torch). It starts a fresh Python
with ``BOOT``, which loads this folder by path as the package ``PACKAGE`` and runs ``main.main``: the
child imports nothing else of trainlint (not libcst, not the parent-side verify modules), and works
the same from a source checkout and from an installed package. This file must stay free of imports.

Modules, lowest first: ``state`` (device, rank), ``capture`` (what a program computed), ``sandbox``
(what protects the child from user code), ``standins`` (synthetic models, optimizers, batches),
``compare`` (tolerances, comparison, the evidence and verdict builders), ``variants`` (a probe's
variants run in turn), ``drivers`` and ``loop_drivers`` (one per probe kind), ``distributed`` (the
two-process gloo group), ``surface`` (what a probe program reaches as ``__tl__``), ``main`` (the
probe loop).
"""

PACKAGE = "trainlint_verify_child"

# argv: this folder, then the arguments of ``main.main``. Used by the parent and by the child for
# its data-parallel workers.
BOOT = (
    "import importlib, importlib.util, os, sys\n"
    f"spec = importlib.util.spec_from_file_location({PACKAGE!r}, os.path.join(sys.argv[1], '__init__.py'),"
    " submodule_search_locations=[sys.argv[1]])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    f"raise SystemExit(importlib.import_module({PACKAGE!r} + '.main').main(sys.argv[2:]))\n"
)
