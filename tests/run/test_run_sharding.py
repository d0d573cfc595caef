"""`trainlint run` on the sampling and sharding hazards: TL505 (a shuffling DistributedSampler's second
training pass runs with the same epoch, so it repeats the order) and TL503 (an optimizer stepping
parameters that FSDP replaced when it wrapped the model), each with its fixed twin, on tiny real runs.
The FSDP runs are one-rank gloo groups in a subprocess (a process group is global state)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore")

SAMPLER = """
import torch
from torch.utils.data import DataLoader, DistributedSampler

data = torch.arange(32.0).unsqueeze(1)
sampler = DistributedSampler(data, num_replicas=2, rank=0)
loader = DataLoader(data, batch_size=4, sampler=sampler)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
for epoch in range(3):
    for batch in loader:
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
"""

FSDP2 = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
fully_shard(model)
try:
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
finally:
    dist.destroy_process_group()
"""
FSDP1 = FSDP2.replace("import fully_shard", "import FullyShardedDataParallel as FSDP").replace(
    "fully_shard(model)", 'model = FSDP(model, device_id=torch.device("cpu"))'
)


POLICY = FSDP2.replace(
    "import fully_shard",
    'import MixedPrecisionPolicy, fully_shard\nDTYPE = getattr(torch, "bfloat16")  # known only at run time',
).replace("fully_shard(model)", "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=DTYPE))")

CLIP = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

dist.init_process_group("gloo")
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
model = FSDP(net, device_id=torch.device("cpu"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
finally:
    dist.destroy_process_group()
"""


def two_ranks(tmp_path: Path, code: str) -> list[dict]:
    """``trainlint run`` on ``code`` in two gloo processes, as torchrun would start them."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code).lstrip("\n"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "trainlint", "run", "--format", "json", "--", "python", str(script)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    return [json.loads(p.communicate(timeout=300)[0]) for p in procs]


def run(tmp_path: Path, code: str, capsys: pytest.CaptureFixture[str] | None = None) -> dict:
    """The JSON report of ``trainlint run`` on ``code``: in this process when ``capsys`` is given (no
    process group), else in a subprocess."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code).lstrip("\n"))
    if capsys is not None:
        from trainlint.run.cli import main

        main(["--format", "json", "--", "python", str(script)])
        data = json.loads(capsys.readouterr().out)
        assert data["run"]["ended"] == "finished", data["run"]
        return data
    cmd = [sys.executable, "-m", "trainlint", "run", "--format", "json", "--", "python", str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    data = json.loads(proc.stdout)
    assert data["run"]["ended"] == "finished", (data["run"], proc.stderr[-2000:])
    return data


def observed(data: dict, rule: str) -> list[dict]:
    return [f for f in data["findings"] if f["rule"] == rule and f["run"]["status"] != "not-reached"]


def test_tl505_second_training_pass_with_the_same_epoch(tmp_path: Path, capsys) -> None:
    (hit,) = observed(run(tmp_path, SAMPLER, capsys), "TL505")
    assert (hit["line"], hit["run"]["status"]) == (5, "seen")
    m = hit["run"]["measured"]
    assert m["epochs_seen"] == [0, 0] and m["same_order"] is True
    assert m["samples_per_pass"] == 16 and m["optimizer_steps_in_first_pass"] == 4


def test_tl505_silent_with_set_epoch_and_for_an_evaluation_sampler(tmp_path: Path, capsys) -> None:
    fixed = SAMPLER.replace(
        "    for batch in loader:", "    sampler.set_epoch(epoch)\n    for batch in loader:"
    )
    assert observed(run(tmp_path, fixed, capsys), "TL505") == []
    # a sampler whose passes take no optimizer step (evaluation) repeats its order harmlessly; the
    # training here has no sampler of this class
    evaluation = (
        SAMPLER.replace("    for batch in loader:", "    for batch in data.split(4):")
        + "    with torch.no_grad():\n        scores = [model(b).sum() for b in loader]\n"
    )
    assert observed(run(tmp_path, evaluation, capsys), "TL505") == []


@pytest.mark.parametrize("code", [FSDP2, FSDP1], ids=["fully_shard", "FSDP1"])
def test_tl503_optimizer_holds_the_replaced_parameters(tmp_path: Path, code: str) -> None:
    (hit,) = observed(run(tmp_path, code), "TL503")
    assert (hit["line"], hit["run"]["status"]) == (7, "seen")
    m = hit["run"]["measured"]
    assert m["stale_parameters"] == m["optimizer_parameters"] == 4
    assert m["stale_with_grad"] == 0 and m["wrapped_at_line"] == 8


@pytest.mark.parametrize(
    "code",
    [
        FSDP2.replace(
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nfully_shard(model)\n",
            "fully_shard(model)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n",
        ),
        FSDP1.replace('device_id=torch.device("cpu")', 'device_id=torch.device("cpu"), use_orig_params=True'),
    ],
    ids=["built_after", "use_orig_params"],
)
def test_tl503_silent_when_the_optimizer_holds_what_the_forward_uses(tmp_path: Path, code: str) -> None:
    assert observed(run(tmp_path, code), "TL503") == []


def test_tl110_policy_resolved_at_run_time_reduces_in_16_bit(tmp_path: Path) -> None:
    (hit,) = observed(run(tmp_path, POLICY), "TL110")
    # the static pass cannot read the dtype: the run reports it on its own
    assert (hit["line"], hit["run"]["status"]) == (9, "runtime-only")
    assert hit["run"]["measured"] == {"param_dtype": "bfloat16", "reduce_dtype": None, "wrapped_at_line": 9}
    fixed = POLICY.replace("param_dtype=DTYPE)", "param_dtype=DTYPE, reduce_dtype=torch.float32)")
    (tmp_path / "fixed").mkdir()
    assert observed(run(tmp_path / "fixed", fixed), "TL110") == []


@pytest.mark.slow
def test_tl506_each_rank_clips_by_its_shards_norm(tmp_path: Path) -> None:
    for data in two_ranks(tmp_path, CLIP):
        (hit,) = observed(data, "TL506")
        assert (hit["line"], hit["run"]["status"]) == (12, "seen")
        m = hit["run"]["measured"]
        # one flat parameter of 4*8 + 8 + 8 + 1 = 49 elements, padded to 50 and split over two ranks
        assert (m["flat_parameters"], m["elements_unsharded"], m["elements_on_this_rank"]) == (1, 49, 25)
        assert m["world_size"] == 2


@pytest.mark.slow
def test_tl506_silent_when_every_rank_holds_whole_parameters(tmp_path: Path) -> None:
    code = CLIP.replace(
        'device_id=torch.device("cpu")',
        'device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD',
    )
    for data in two_ranks(tmp_path, code):
        assert data["run"]["ended"] == "finished"
        assert observed(data, "TL506") == []
