"""What protects the child from the user's code and the user's code from the child's machinery.

Within the child: no network (a Python-level block, under the network namespace the parent sets up
where the system allows one: its loopback is brought up here for the data-parallel probes), deterministic
torch on one thread, CUDA-only code redirected to the CPU, each program in a fresh namespace with its
stdout sent to stderr (results travel through a pipe on a descriptor no process the snippet starts
inherits), a time limit per probe, and every exception of user code (``SystemExit`` included) turned into
a ``VariantFailed`` a driver can report. Names the harness could not bind are ``Unbound``: any use
raises. The resource limits, the namespaces and the temporary working folder are set by the parent
(``runner.py``), which also validates every result.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator

import torch

from . import capture, state

# descriptors of the child that no process forked from it may keep (the results pipe, the pipe the
# job is released through): a forked data-parallel worker closes them before it runs any user code
_private_fds: set[int] = set()
# read by the compiler's configuration when it is first imported (its ``deterministic`` flag)
COMPILER_DETERMINISTIC = "TORCHINDUCTOR_DETERMINISTIC"


class UnboundName(BaseException):
    """A name the harness could not bind was used by the snippet."""


class ProbeTimeout(BaseException):
    pass


class Unbound:
    """Stand-in for a name that could not be bound: any use raises ``UnboundName``."""

    touched: list[str] = []

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_tl_name", name)

    def _fail(self, *args, **kwargs):
        name = object.__getattribute__(self, "_tl_name")
        Unbound.touched.append(name)
        raise UnboundName(name)

    def __getattr__(self, attr):
        name = object.__getattribute__(self, "_tl_name")
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unbound(f"{name}.{attr}")

    __call__ = _fail
    __bool__ = _fail
    __iter__ = _fail
    __len__ = _fail
    __getitem__ = _fail
    __setitem__ = _fail
    __index__ = _fail
    __int__ = _fail
    __float__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _fail
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __neg__ = __pos__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = _fail
    __eq__ = __ne__ = _fail  # ``dtype == "float16"`` must not quietly be False
    __contains__ = _fail
    __hash__ = object.__hash__
    __enter__ = __exit__ = _fail

    def __repr__(self) -> str:
        return f"<unbound {object.__getattribute__(self, '_tl_name')}>"


def setup_process(device: str) -> None:
    state.DEVICE = device
    state.LOW_DTYPE = torch.float16 if device == "cuda" else torch.bfloat16
    torch.set_num_threads(1)
    deterministic()
    if device == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    _loopback_up()
    _block_network()
    capture.install_token_counter()
    if device == "cpu":
        _cpu_only_patches()


def deterministic() -> None:
    """Deterministic algorithms (warnings only), without importing the compiler.

    ``torch.use_deterministic_algorithms`` imports ``torch._inductor`` (and with it ``torch._dynamo``),
    over a second of the child's start-up, only to set the compiler's ``deterministic`` flag; that
    flag is read from ``TORCHINDUCTOR_DETERMINISTIC`` when the compiler is first imported, so setting
    the variable and the core switch gives the same mode. Where the switch is missing, or the compiler
    is already loaded (the variable would come too late), the public call does it all."""
    os.environ[COMPILER_DETERMINISTIC] = "1"
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is not None and "torch._inductor.config" not in sys.modules:
        try:
            switch(True, warn_only=True)
            return
        except TypeError:  # another signature in another torch release
            pass
    torch.use_deterministic_algorithms(True, warn_only=True)


def load_compiler() -> None:
    """Import the compiler (``torch._dynamo``, which loads the inductor's configuration) now, in its
    deterministic mode. The first optimizer step, checkpoint or DDP wrap of a probe imports it anyway,
    over a second, and would do so inside that probe's time limit; the child does it while it waits
    for its job, when the import overlaps the parent's building of the probes."""
    os.environ[COMPILER_DETERMINISTIC] = "1"
    importlib.import_module("torch._dynamo")


def results_channel(target: str) -> Callable[[dict], None]:
    """How results reach the parent: ``fd:N`` is the write end of the parent's pipe, moved to a
    descriptor that processes started by the snippet do not inherit; a path is appended to (tests)."""
    if not target.startswith("fd:"):

        def append(item: dict) -> None:
            with open(target, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(item) + "\n")

        return append
    inherited = int(target[3:])
    fd = os.dup(inherited)  # not inheritable
    _private_fds.add(fd)
    os.close(inherited)

    def send(item: dict) -> None:
        data = (json.dumps(item) + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]

    return send


def private_fd(fd: int) -> int:
    """Mark ``fd`` as the child's alone (see ``close_private_fds``) until ``close_private_fd``."""
    _private_fds.add(fd)
    return fd


def close_private_fd(fd: int) -> None:
    _private_fds.discard(fd)  # first: the number may be reused once it is closed
    os.close(fd)


def close_private_fds() -> None:
    """In a process forked from the child (a data-parallel worker): the results pipe and the job pipe
    are the child's alone, so that the user code the worker runs cannot write a result."""
    for fd in sorted(_private_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _private_fds.clear()


def _loopback_up() -> None:
    """In a fresh network namespace the loopback interface is down; the data-parallel probes need it
    (it reaches nothing outside the namespace). Where it is up already, or cannot be, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
            if not flags & iff_up:
                fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    except OSError:
        pass


def _block_network() -> None:
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access is disabled while trainlint runs a probe")

    # the namespace (runner.py) is the real barrier; this one stands alone where there is none
    for method in ("connect", "connect_ex", "sendto", "sendmsg"):
        setattr(socket.socket, method, refuse)
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]


def _cpu_only_patches() -> None:
    """Let code written for a GPU run on the CPU: ``.cuda()`` keeps tensors where they are, CUDA
    autocast becomes CPU autocast with bf16, CUDA GradScalers become CPU ones."""

    def keep(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = keep  # type: ignore[method-assign]
    torch.nn.Module.cuda = keep  # type: ignore[method-assign]

    orig_to_tensor = torch.Tensor.to
    orig_to_module = torch.nn.Module.to

    def _strip(args, kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return args, kwargs

    def tensor_to(self, *args, **kwargs):
        args, kwargs = _strip(args, kwargs)
        return orig_to_tensor(self, *args, **kwargs)

    def module_to(self, *args, **kwargs):
        args, kwargs = _strip(args, kwargs)
        return orig_to_module(self, *args, **kwargs)

    torch.Tensor.to = tensor_to  # type: ignore[method-assign]
    torch.nn.Module.to = module_to  # type: ignore[method-assign]

    orig_autocast = torch.autocast

    class cpu_autocast(orig_autocast):
        def __init__(self, device_type="cpu", dtype=None, enabled=True, cache_enabled=None):
            if device_type == "cuda":
                device_type = "cpu"
            if dtype in (torch.float16, None):
                dtype = torch.bfloat16
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.autocast = cpu_autocast  # type: ignore[misc]
    torch.amp.autocast = cpu_autocast  # type: ignore[misc]

    def cuda_amp_autocast(enabled=True, dtype=torch.float16, cache_enabled=True):
        return cpu_autocast("cpu", dtype=dtype, enabled=enabled)

    torch.cuda.amp.autocast = cuda_amp_autocast  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]


def _is_cuda(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return False


def seed(n: int = 0) -> None:
    import random

    random.seed(n)
    torch.manual_seed(n)
    try:
        import numpy

        numpy.random.seed(n)
    except ImportError:
        pass


def describe_exception(exc: BaseException) -> str:
    if isinstance(exc, UnboundName):
        return f"uses `{exc.args[0]}`, which the harness cannot build"
    if type(exc) is NameError and getattr(exc, "name", None):
        return f"uses `{exc.name}`, which the harness cannot build (it is not defined in the file)"
    if isinstance(exc, SystemExit):
        return f"the snippet called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "the snippet raised KeyboardInterrupt"
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(
        ": "
    )
    return capture.in_user_terms(exc, text)


class VariantFailed(Exception):
    def __init__(self, exc: BaseException) -> None:
        super().__init__(describe_exception(exc))
        self.exc = exc


def exec_program(code: str, filename: str) -> dict:
    """Execute a variant program in a fresh namespace (user stdout goes to stderr). Its text is put
    in ``linecache`` so that ``inspect.getsource`` works (``torch.jit.script`` needs it). Any error
    of the user's carried code is raised as ``VariantFailed``."""
    import linecache

    # imported here: the surface imports every module of the child, this one included
    surface = importlib.import_module(f"{__package__}.surface")
    ns: dict = {"__name__": "__trainlint_probe__", "__tl__": surface}
    surface.config_defaults({})  # settings defaults are per program (set by `bind.Program.render`)
    Unbound.touched.clear()
    capture.hit_counts.clear()
    capture.records.clear()
    capture.batch_valid.clear()
    capture.tokens_seen.clear()
    filename = f"<trainlint-probe-{filename.strip('<>')}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    try:
        compiled = compile(code, filename, "exec")
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compiled, ns)
    except ProbeTimeout:
        raise
    except BaseException as exc:
        raise VariantFailed(exc) from exc
    if Unbound.touched:
        raise VariantFailed(UnboundName(Unbound.touched[0]))
    return ns


def call_user(fn, *args, **kwargs):
    """Run user code: stdout is redirected (probe results travel separately) and any exception,
    SystemExit included, is wrapped."""
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = fn(*args, **kwargs)
    except ProbeTimeout:
        raise
    except BaseException as exc:
        raise VariantFailed(exc) from exc
    if Unbound.touched:
        raise VariantFailed(UnboundName(Unbound.touched[0]))
    return value, [str(w.message) for w in caught]


def is_binding(exc: VariantFailed) -> bool:
    return isinstance(exc.exc, UnboundName | SystemExit) or (
        type(exc.exc) is NameError and bool(getattr(exc.exc, "name", None))
    )


def _alarm(signum, frame):
    raise ProbeTimeout()


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``ProbeTimeout`` in the code run inside once ``seconds`` have passed."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
