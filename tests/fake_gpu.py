"""A CUDA GPU faked on a CPU-only torch, so that the CPU tests run the scripts' CUDA-only lines
(docs/gpus.md says what that checks and what it cannot). torch.cuda answers as the GPU with torch's
own signatures, "cuda" tensors live on the CPU, autocast, GradScaler and NCCL run as the CPU's; torch's
own code keeps seeing the CPU build. FakeGPU.asked records what the program asked; LINES_RUN, the
lines of SCANNED files that ran. faked() exports FAKE_GPU and puts tests/fake_gpu_boot on PYTHONPATH,
so that the processes a test starts install the same fake."""

import ast
import contextlib
import functools
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
BOOT = Path(__file__).resolve().parent / "fake_gpu_boot"
GiB = 2**30

# name (torch.cuda.get_device_name), compute capability, memory as CUDA reports it, SM count
GPUS = {
    "H100": dict(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory=int(79.1 * GiB), sms=132),
    "A100 80GB": dict(name="NVIDIA A100-SXM4-80GB", capability=(8, 0), memory=int(79.2 * GiB), sms=108),
    "A100": dict(name="NVIDIA A100-SXM4-40GB", capability=(8, 0), memory=int(39.4 * GiB), sms=108),
    "RTX 3090": dict(name="NVIDIA GeForce RTX 3090", capability=(8, 6), memory=int(23.6 * GiB), sms=82),
    "A4000": dict(name="NVIDIA RTX A4000", capability=(8, 6), memory=int(15.7 * GiB), sms=48),
    "T4": dict(name="Tesla T4", capability=(7, 5), memory=int(14.7 * GiB), sms=40),
}

# the files whose lines are recorded when they run under the fake: the scripts and their modules
SCANNED = ("train_gpt2.py", "hellaswag.py", "bench.py", "support/*.py", "benchmarks/*.py")
SCANNED_FILES = {str(p) for pattern in SCANNED for p in ROOT.glob(pattern)}
LINES_RUN = set()  # (path, line number)


def device_properties():
    """{attribute: a zero of its type} of get_device_properties()'s result, as torch's type stubs declare them."""
    stubs = Path(torch.__file__).parent / "_C" / "__init__.pyi"
    for node in ast.parse(stubs.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "_CudaDeviceProperties":
            fields = [n for n in node.body if isinstance(n, ast.AnnAssign)]
            return {n.target.id: "" if ast.unparse(n.annotation) == "str" else 0 for n in fields}
    raise RuntimeError(f"{stubs} declares no _CudaDeviceProperties")


def asked_by_the_project():
    """Whether the stub's caller is the project's code (under ROOT outside site-packages, or `python -c`)."""
    path = sys._getframe(3).f_code.co_filename  # up from here: the fake, stub()'s wrapper, its caller
    return path == "<string>" or (path.startswith(str(ROOT)) and f"{os.sep}site-packages{os.sep}" not in path)


def stub(real, fake):
    """fake, called as real is: bound to real's signature (real's TypeError), then passed to fake by name."""
    signature = inspect.signature(real)

    @functools.wraps(real)
    def called(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return fake(**bound.arguments)

    return called


def on_the_cpu(real, argument):
    """A subclass of the class real, the same signature, whose `argument` "cuda" is "cpu"."""
    signature = inspect.signature(real.__init__)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get(argument) == "cuda":
            bound.arguments[argument] = "cpu"
        real.__init__(*bound.args, **bound.kwargs)

    __init__.__signature__ = signature
    return type(real.__name__, (real,), {"__init__": __init__, "__module__": real.__module__})


class CudaOnTheCPU(TorchFunctionMode):
    """Tensors on "cuda"/"cuda:N" live on the CPU; a call FakeGPU.out_of_memory names raises CUDA's OOM error."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.gpu.maybe_out_of_memory(func, args, kwargs)
        if func is torch.Tensor.cuda:  # (self, device=None, non_blocking=False, ...)
            self.gpu.index(args[1] if len(args) > 1 else kwargs.get("device"))
            return args[0]
        if func is torch.Tensor.pin_memory:
            self.gpu.record("pin_memory")
            return args[0]
        if "device" in kwargs:
            kwargs = {**kwargs, "device": self.gpu.cpu(kwargs["device"])}
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], self.gpu.cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class FakeGPU:
    def __init__(self, gpu="H100", count=1):
        spec = GPUS[gpu]
        self.count, self.current = count, 0
        self.name, self.capability, self.memory = spec["name"], spec["capability"], spec["memory"]
        values = device_properties()  # the ones not set here stay zero: nothing reads them
        values.update(name=self.name, major=self.capability[0], minor=self.capability[1], total_memory=self.memory)
        values.update(multi_processor_count=spec["sms"], warp_size=32)
        properties = type("_CudaDeviceProperties", (), {"__slots__": list(values), "__repr__": lambda p: p.name})
        self.properties = properties()
        for attribute, value in values.items():
            setattr(self.properties, attribute, value)
        self.asked = []  # (function, its arguments), in the order the program asked
        self.nccl = False  # the default process group was asked for as NCCL
        self.oom = None  # (when, how many more), see out_of_memory
        self.mode = CudaOnTheCPU(self)

    def index(self, device):
        """The GPU index device names (None: the current one), checked as CUDA checks it."""
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            device = device.index
        if device is None:
            return self.current
        if not isinstance(device, int) or isinstance(device, bool):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        if not 0 <= device < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return device

    def cpu(self, device):
        """The CPU for a CUDA device (its index checked), any other device as it is."""
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            self.index(torch.device(device))
            return torch.device("cpu")
        return device

    def record(self, name, *args):
        self.asked.append((name, args))

    def asked_for(self, name):
        """The arguments of each call of name, in order."""
        return [args for n, args in self.asked if n == name]

    def out_of_memory(self, when, times=None):
        """A torch call for which when(func, args, kwargs) holds raises CUDA's OutOfMemoryError (times: None, all)."""
        self.oom = (when, times)

    def maybe_out_of_memory(self, func, args, kwargs):
        when, times = self.oom or (None, None)
        if when is None or times == 0 or not when(func, args, kwargs):
            return
        self.oom = (when, None if times is None else times - 1)
        raise torch.OutOfMemoryError(  # CUDA's words
            f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU {self.current} has a total capacity of "
            f"{self.memory / GiB:.2f} GiB of which 1.02 GiB is free."
        )

    # --- torch.cuda, as a GPU answers ------------------------------------------------------------

    def stubs(self):
        """{torch.cuda function: its fake}, each called with the real one's arguments by name (stub)."""

        def of_device(value):  # value, once device is checked
            def fake(device):
                self.index(device)
                return value

            return fake

        def recorded(name, result=None):
            def fake(device=None):
                self.record(name, self.index(device))
                return result

            return fake

        def set_device(device):
            self.record("set_device", device)
            self.current = self.index(device)

        def to_the_project(name, value):  # value to the project's code, the real answer to torch's
            real = getattr(torch.cuda, name)
            return lambda: value if asked_by_the_project() else real()

        return dict(
            is_available=to_the_project("is_available", True),
            is_initialized=to_the_project("is_initialized", True),
            device_count=to_the_project("device_count", self.count),
            get_device_name=of_device(self.name),
            get_device_capability=of_device(self.capability),
            get_device_properties=of_device(self.properties),
            set_device=set_device,
            synchronize=recorded("synchronize"),
            empty_cache=lambda: self.record("empty_cache"),
            # the fake cannot measure GPU memory: its statistics are zeros, their asking recorded
            max_memory_allocated=recorded("max_memory_allocated", 0),
            reset_peak_memory_stats=recorded("reset_peak_memory_stats"),
        )

    def install(self, monkeypatch):
        """The fake in place; monkeypatch (pytest's MonkeyPatch) undoes the patches, uninstall() the rest."""
        for name, fake in self.stubs().items():
            monkeypatch.setattr(torch.cuda, name, stub(getattr(torch.cuda, name), fake))
        precision, sdp = torch.set_float32_matmul_precision, torch.backends.cuda.enable_cudnn_sdp
        monkeypatch.setattr(torch, "set_float32_matmul_precision", stub(precision, self.matmul_precision))
        cudnn_sdp = stub(sdp, lambda enabled: self.record("enable_cudnn_sdp", enabled) or sdp(enabled))
        monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", cudnn_sdp)
        autocast = on_the_cpu(torch.amp.autocast_mode.autocast, "device_type")
        monkeypatch.setattr(torch, "autocast", autocast)
        monkeypatch.setattr(torch.amp, "autocast", autocast)
        monkeypatch.setattr(torch.amp, "GradScaler", on_the_cpu(torch.amp.GradScaler, "device"))
        monkeypatch.setattr(torch, "Generator", self.generator_class())
        monkeypatch.setattr(dist, "init_process_group", stub(dist.init_process_group, self.init_process_group))
        monkeypatch.setattr(dist, "get_backend", stub(dist.get_backend, self.get_backend))
        ddp = DistributedDataParallel.__init__
        monkeypatch.setattr(DistributedDataParallel, "__init__", stub(ddp, self.ddp_init(ddp)))
        # what the program may switch is put back afterwards: cuDNN's flags, the variable cuBLAS reads
        for flag in ("deterministic", "benchmark"):
            monkeypatch.setattr(torch.backends.cudnn, flag, getattr(torch.backends.cudnn, flag))
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        self.saved = self.switches()
        self.mode.__enter__()

    def uninstall(self):
        self.mode.__exit__(None, None, None)
        torch._C._set_float32_matmul_precision(self.saved["matmul_precision"])
        torch._C._set_sdp_use_cudnn(self.saved["cudnn_sdp"])
        torch.use_deterministic_algorithms(self.saved["deterministic_algorithms"])
        if "torch._inductor.config" in sys.modules:  # set_deterministic switches Inductor's too
            sys.modules["torch._inductor.config"].deterministic = self.saved["inductor_deterministic"]

    def switches(self):
        """What the program may have switched for the GPU, as it stands now."""
        return {
            "matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "inductor_deterministic": getattr(sys.modules.get("torch._inductor.config"), "deterministic", False),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }

    # --- the rest of torch, where a GPU and the CPU differ ---------------------------------------

    def matmul_precision(self, precision):
        """torch.set_float32_matmul_precision, which raises where torch only warns (and ignores it)."""
        if precision not in ("highest", "high", "medium"):
            raise ValueError(f"set_float32_matmul_precision({precision!r}): torch would warn and ignore it")
        self.record("set_float32_matmul_precision", precision)
        torch._C._set_float32_matmul_precision(precision)

    def generator_class(self):
        gpu = self

        class Generator(torch._C.Generator):
            def __new__(cls, device="cpu"):
                return super().__new__(cls, device=gpu.cpu(device))

        return Generator

    def init_process_group(self, backend, **arguments):
        self.record("init_process_group", backend)
        if backend is not None and "nccl" in backend:
            self.nccl = True
            backend = backend.replace("nccl", "gloo")
        return dist.distributed_c10d.init_process_group(backend, **arguments)

    def get_backend(self, group):
        backend = dist.distributed_c10d.get_backend(group)
        return dist.Backend("nccl") if self.nccl and group is None and backend == "gloo" else backend

    def ddp_init(self, real):
        def init(**arguments):
            if arguments["device_ids"]:  # a GPU's module: the CPU module here takes none
                self.record("DistributedDataParallel", [self.index(i) for i in arguments["device_ids"]])
                arguments.update(device_ids=None, output_device=None)
            return real(**arguments)

        return init


def record_line(frame, event, arg):
    """sys.settrace's tracer that adds the lines of SCANNED_FILES that run to LINES_RUN."""
    if event == "line":
        LINES_RUN.add((frame.f_code.co_filename, frame.f_lineno))
    return record_line if event != "call" or frame.f_code.co_filename in SCANNED_FILES else None


@contextlib.contextmanager
def faked(gpu="H100", count=1):
    """count GPUs of GPUS[gpu] in this process and the ones it starts, their lines recorded, until the block ends."""
    fake, before = FakeGPU(gpu, count), sys.gettrace()
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake.install(monkeypatch)
        monkeypatch.setenv("FAKE_GPU", f"{gpu},{count}")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(BOOT), os.environ.get("PYTHONPATH")])))
        sys.settrace(record_line)
        try:
            yield fake
        finally:
            sys.settrace(before)
            fake.uninstall()
            if os.environ.get("FAKE_GPU_LINES"):  # a pytest run that test_fake_gpu.py started reports them
                with open(os.environ["FAKE_GPU_LINES"], "a") as f:
                    f.writelines(f"{path}:{line}\n" for path, line in LINES_RUN)


def install_from_env():
    """The fake FAKE_GPU names ("H100" or "H100,2"), for the rest of the process (fake_gpu_boot)."""
    gpu, _, count = os.environ["FAKE_GPU"].partition(",")
    fake = FakeGPU(gpu, int(count or 1))
    fake.install(pytest.MonkeyPatch())
    return fake
