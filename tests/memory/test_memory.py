"""``trainlint memory``: the measured bill, the per-rank projection, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainlint.memory.cli import main  # noqa: E402
from trainlint.memory.measure import measure  # noqa: E402
from trainlint.memory.project import Measured, PhasePeak, project, project_all  # noqa: E402
from trainlint.memory.train import Setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.memory import models  # noqa: E402

MLP = {"width": 32, "depth": 2, "d_in": 16, "d_out": 4}
GPT = {"vocab": 64, "d": 32, "heads": 2, "layers": 2, "max_len": 32}


def mlp_numel(width: int, depth: int, d_in: int, d_out: int) -> tuple[int, int]:
    """Parameter count and tensor count of ``models.mlp``, by hand: (in*out + out) per Linear."""
    shapes = [(d_in, width)] + [(width, width)] * (depth - 1) + [(width, d_out)]
    return sum(i * o + o for i, o in shapes), 2 * len(shapes)


def run(**kw) -> Measured:
    build = kw.pop("build", lambda: models.mlp(**MLP))
    return measure(Setup(build=build, batch_size=kw.pop("batch_size", 4), **kw))[0]


# -- the article's arithmetic --------------------------------------------------------------------
def test_projection_matches_the_zero_arithmetic_for_8_ranks() -> None:
    p = 10**9  # 1e9 parameters, mixed-precision Adam: 2 + 2 + 4 + 8 bytes each
    m = Measured(p, p, weights=2 * p, buffers=0, gradients=2 * p, master=4 * p, optimizer=8 * p, peaks=[])
    states = {o: project(m, o, world=8).model_state for o in ("ddp", "zero1", "zero2", "zero3")}
    assert states["ddp"] == 16 * p  # data parallelism alone shards nothing
    assert states["zero1"] == 2 * p + 2 * p + 12 * p // 8  # 5.5 GB: optimizer state + master sharded
    assert states["zero2"] == 2 * p + 14 * p // 8  # 3.75 GB: gradients sharded too
    assert states["zero3"] == 16 * p // 8  # 2 GB: everything sharded


def test_bf16_master_adamw_is_16_bytes_per_parameter() -> None:
    n, tensors = mlp_numel(**MLP)
    m = run(precision="bf16-master")
    assert (m.weights, m.gradients, m.master) == (2 * n, 2 * n, 4 * n)
    assert m.optimizer == 8 * n + 4 * tensors  # two fp32 moments, plus a 4-byte fp32 step per tensor
    zero1 = project(m, "zero1", world=8)
    assert zero1.terms["master"] == -(-4 * n // 8)
    assert zero1.model_state == 2 * n + 2 * n + -(-4 * n // 8) + -(-(8 * n + 4 * tensors) // 8)


def test_optimizer_state_follows_the_optimizer() -> None:
    n, _ = mlp_numel(**MLP)
    assert run(optimizer="SGD", optimizer_kwargs={"lr": 0.1}).optimizer == 0
    assert run(optimizer="SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9}).optimizer == 4 * n
    assert run(precision="bf16").optimizer > 0  # pure bf16: moments in bf16, no master copy
    pure = run(precision="bf16")
    assert pure.master == 0 and pure.weights == 2 * n


def test_grad_scaler_state_is_billed_with_the_optimizer() -> None:
    fp16, bf16 = run(precision="amp-fp16"), run(precision="amp-bf16")
    assert fp16.optimizer - bf16.optimizer == 4 + 4  # fp32 scale + int32 growth tracker


def test_batchnorm_buffers_are_weights_that_are_never_sharded() -> None:
    m = run(
        build=lambda: models.cnn(channels=4, depth=2),
        input_shape=(3, 8, 8),
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1},
    )
    channels = 4 + 8
    assert m.buffers == 2 * 4 * channels + 2 * 8  # running mean/var (fp32) + num_batches_tracked (int64)
    zero3 = project(m, "zero3", world=4)
    assert zero3.terms["weights"] == m.buffers + -(-(m.weights - m.buffers) // 4)


# -- activations ---------------------------------------------------------------------------------
def gpt(**kw) -> Measured:
    return run(build=lambda: models.gpt(**GPT), seq_len=16, **kw)


def test_checkpointing_and_accumulation_shrink_activations() -> None:
    act = {}
    for name, kw in {"plain": {}, "ckpt": {"checkpointing": True}}.items():
        m = gpt(batch_size=4, **kw)
        act[name] = max(p.by_kind["activations"] for p in m.peaks)
    assert act["ckpt"] < act["plain"]
    big = max(p.by_kind["activations"] for p in gpt(batch_size=4).peaks)
    accum = max(p.by_kind["activations"] for p in gpt(batch_size=2, grad_accum=2).peaks)
    assert accum < big


def test_activation_peak_is_attributed_to_module_and_line() -> None:
    m = gpt(batch_size=2)
    assert m.activation_sites
    assert any(mod.startswith("blocks.") and "models.py:" in line for mod, line, _ in m.activation_sites)


def test_data_dependent_forward_falls_back_to_model_state_with_a_warning() -> None:
    m = run(build=lambda: models.routed(8))
    assert not m.activations_measured
    assert m.weights == 4 * (8 * 8 + 8) and m.optimizer > 0
    assert "nonzero" in m.warnings[0] and "models.py" in m.warnings[0]


def test_projection_adds_buckets_for_ddp_and_gathered_unit_for_zero3() -> None:
    peak = PhasePeak("step1.backward", "backward", {"weights": 100, "activations": 50})
    m = Measured(
        25,
        25,
        weights=100,
        buffers=0,
        gradients=100,
        master=0,
        optimizer=200,
        peaks=[peak],
        unit_weights=40,
        unit_grads=40,
    )
    m.peaks.append(PhasePeak("build", "build", {"weights": 100, "temporaries": 10**6}))  # not projected
    by = {p.option: p for p in project_all(m, world=4)}
    assert by["ddp"].terms["comm"] == 100 and by["ddp"].peak == 100 + 50 + 100
    assert by["zero3"].terms["comm"] == 80 and by["zero3"].peak == 25 + 50 + 80
    assert by["cpu-offload"].host == {"weights": 25, "gradients": 25, "master": 0, "optimizer": 50}


# -- command line --------------------------------------------------------------------------------
def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_gives_each_option_its_terms_and_peak(monkeypatch, capsys) -> None:
    code, out, _ = cli(
        monkeypatch,
        capsys,
        "--model",
        "bench.memory.models:mlp",
        "--model-kwargs",
        json.dumps(MLP),
        "--batch-size",
        "4",
        "--precision",
        "bf16-master",
        "--world-size",
        "8",
        "--format",
        "json",
    )
    assert code == 0
    data = json.loads(out)
    n, _ = mlp_numel(**MLP)
    assert data["parameters"] == n
    assert set(data["options"]) == {"ddp", "zero1", "zero2", "zero3", "fsdp-hybrid", "cpu-offload"}
    ddp = data["options"]["ddp"]
    assert ddp["per_rank"]["weights"] == 2 * n and ddp["peak"] >= ddp["model_state"]
    assert data["options"]["zero3"]["model_state"] < data["options"]["zero1"]["model_state"]


def test_cli_text_names_the_options(monkeypatch, capsys) -> None:
    code, out, _ = cli(
        monkeypatch, capsys, "--model", "bench.memory.models:mlp", "--model-kwargs", json.dumps(MLP)
    )
    assert code == 0 and "ZeRO-1" in out and "peak" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "bench.memory.models:mlp", "--model-kwargs", "{bad"], "not valid JSON"),
        (["--model", "bench.memory.models:nothing"], "has no 'nothing'"),
        (["--model", "no_such_module_xyz:f"], "cannot import"),
        (["--model", "bench.memory.models:mlp", "--optimizer", "Nope"], "unknown optimizer"),
        (["--model", "bench.memory.models:mlp", "--hf", "x"], "exactly one"),
        (["--model", "bench.memory.models:cnn"], "--input-shape"),
        (["--model", "bench.memory.models:mlp", "--batch-size", "0"], "positive"),
        (["--model", "bench.memory.models:mlp", "--model-kwargs", '{"widht": 3}'], "factory raised"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, message) -> None:
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_reads_a_toml_config(monkeypatch, capsys, tmp_path) -> None:
    cfg = tmp_path / "mem.toml"
    cfg.write_text(
        'model = "bench.memory.models:mlp"\nmodel-kwargs = {width = 8, depth = 1}\n'
        'optimizer = "SGD"\noptimizer_kwargs = {lr = 0.1}\nformat = "json"\n'
    )
    code, out, _ = cli(monkeypatch, capsys, "--config", str(cfg))
    assert code == 0
    assert json.loads(out)["parameters"] == 64 * 8 + 8 + 8 * 10 + 10


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = cli(
        monkeypatch,
        capsys,
        "--model",
        "bench.memory.models:mlp",
        "--model-kwargs",
        json.dumps(MLP),
        "--plot",
        str(tmp_path / "bill.png"),
    )
    assert code == 2 and "memory-plot" in err


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_plot_stacks_each_options_terms(monkeypatch, capsys, tmp_path, suffix, magic) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn: list[list[float]] = []
    bar = Axes.bar

    def recording_bar(self, x, height, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(list(height))
        return bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", recording_bar)
    picture = tmp_path / f"bill{suffix}"
    code, out, _ = cli(
        monkeypatch, capsys, "--model", "bench.memory.models:mlp", "--model-kwargs", json.dumps(MLP),
        "--format", "json", "--plot", str(picture),
    )  # fmt: skip
    assert code == 0 and magic in picture.read_bytes()[:300]
    options = json.loads(out)["options"].values()
    # one stacked layer per term; each option's bar adds up to its terms' bytes (in the chart's unit)
    assert len(drawn) == 7
    totals = [sum(layer[i] for layer in drawn) for i in range(len(options))]
    exact = [sum(v or 0 for v in o["per_rank"].values()) for o in options]
    scale = exact[0] / totals[0]
    assert scale in [pytest.approx(2**k) for k in (0, 10, 20, 30)]
    assert totals == pytest.approx([e / scale for e in exact])


LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_hf_builds_a_llama_config_and_bills_it(monkeypatch, capsys, tmp_path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, out, err = cli(
        monkeypatch, capsys, "--hf", str(tmp_path), "--seq-len", "16", "--precision", "bf16-master",
        "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    h, inter, vocab, layers = 64, 172, 128, 2
    # by hand: embeddings and head (no bias), per layer 4 attention projections, 3 MLP ones, 2 norms
    n = 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h
    assert data["parameters"] == n
    single = data["single_process"]
    assert single["master"] == 4 * n and single["gradients"] == 2 * n
    assert data["complete"] and single["peak"] > single["model_state"]


def test_hf_without_transformers_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = cli(monkeypatch, capsys, "--hf", "some/config", "--seq-len", "8")
    assert code == 2 and "transformers" in err


def test_importing_the_memory_package_does_not_import_torch() -> None:
    code = "import sys, trainlint.cli, trainlint.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
