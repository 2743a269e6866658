"""``deepspeed.accelerator.real_accelerator``: the accelerator object DeepSpeed scripts get from
``get_accelerator()``, with DeepSpeed 0.19.8's method names and answers, for the two
devices this engine runs on:

- CUDA (torch sees a GPU): each method is torch.cuda's (``device_name(i)`` -> ``"cuda:i"``,
  ``communication_backend_name()`` -> ``"nccl"``, ``Stream``/``Event`` the CUDA classes, ...);
- CPU: no CUDA call anywhere; ``device_name()`` -> ``"cpu"``, backend ``"gloo"``,
  ``synchronize``/``empty_cache``/``set_device`` do nothing, memory figures are the process's
  resident set (psutil), as DeepSpeed's CPU accelerator; ``Stream``/``Event`` are None and
  ``stream(s)`` a null context. Two differences from DeepSpeed's CPU accelerator:
  ``current_device()`` is the launcher's local rank as an int (DeepSpeed returns the
  ``LOCAL_RANK`` string), and ``device_count()`` is the launcher's local world size (or 1)
  where DeepSpeed counts NUMA nodes without ``LOCAL_SIZE``.

Op builders, CUDA graphs and compile backends are DeepSpeed internals the engine does not
have: those methods raise :class:`~engine.compat.deepspeed._unsupported.UnsupportedFeatureError`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NoReturn, Optional, Union

import torch

from engine.compat.deepspeed._unsupported import UnsupportedFeatureError
from engine.distributed.env import current_launch

__all__ = ["DeepSpeedAccelerator", "CPU_Accelerator", "CUDA_Accelerator", "get_accelerator", "set_accelerator",
           "is_current_accelerator_supported"]

Index = Optional[int]


class DeepSpeedAccelerator:
    """What the CPU and CUDA accelerators share: names, dtypes, RNG and tensor helpers."""

    _name = "?"
    _communication_backend_name = "?"

    # ---------------------------------------------------------------- names
    def device_name(self, device_index: Index = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---------------------------------------------------------------- RNG (torch's default generator)
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # ---------------------------------------------------------------- dtypes
    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float]
        if self.is_fp16_supported():
            out.append(torch.half)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def is_triton_supported(self) -> bool:
        return False

    # ---------------------------------------------------------------- tensors
    @property
    def BFloat16Tensor(self) -> Any:
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> Any:
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> Any:
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> Any:
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> Any:
        return torch.HalfTensor

    @property
    def IntTensor(self) -> Any:
        return torch.IntTensor

    @property
    def LongTensor(self) -> Any:
        return torch.LongTensor

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    # ---------------------------------------------------------------- DeepSpeed internals: refused
    def _refuse(self, what: str) -> NoReturn:
        raise UnsupportedFeatureError(f"get_accelerator().{what} is not supported by this engine: DeepSpeed's op "
                                      "builders, CUDA graphs and compile backends are its internals (the engine "
                                      "builds its own ops: engine.ops)")

    def op_builder_dir(self) -> NoReturn:
        self._refuse("op_builder_dir()")

    def create_op_builder(self, op_name: str) -> NoReturn:
        self._refuse("create_op_builder()")

    def get_op_builder(self, class_name: str) -> NoReturn:
        self._refuse("get_op_builder()")

    def build_extension(self) -> NoReturn:
        self._refuse("build_extension()")

    def create_graph(self) -> NoReturn:
        self._refuse("create_graph()")

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> NoReturn:
        self._refuse("capture_to_graph()")

    def replay_graph(self, graph: Any) -> NoReturn:
        self._refuse("replay_graph()")

    def get_compile_backend(self) -> NoReturn:
        self._refuse("get_compile_backend()")

    def set_compile_backend(self, backend: str) -> NoReturn:
        self._refuse("set_compile_backend()")


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 (DeepSpeed's class name)
    """The CPU: no CUDA call in any method."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._max_rss = 0

    def device(self, device_index: Index = None) -> None:
        return None  # as DeepSpeed's CPU accelerator

    def set_device(self, device_index: Any) -> None:
        return None

    def current_device(self) -> int:
        return current_launch().local_rank

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return current_launch().local_world_size or 1

    def synchronize(self, device_index: Index = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        mkldnn = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
        return bool(mkldnn()) if mkldnn is not None else False

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def get_rng_state(self, device_index: Index = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Index = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: Index = None) -> torch.Generator:
        return torch.default_generator

    # streams and events: none on the host
    @property
    def Stream(self) -> None:
        return None

    @property
    def Event(self) -> None:
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: Index = None) -> None:
        return None

    def default_stream(self, device_index: Index = None) -> None:
        return None

    # memory: the process's resident set, as DeepSpeed's CPU accelerator
    def _rss(self) -> int:
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        self._max_rss = max(self._max_rss, rss)
        return rss

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: Index = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: Index = None) -> int:
        self._rss()
        return self._max_rss

    def reset_max_memory_allocated(self, device_index: Index = None) -> None:
        self._max_rss = 0
        self._rss()

    reset_peak_memory_stats = reset_max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated
    memory_reserved = memory_allocated
    memory_cached = memory_allocated
    max_memory_reserved = max_memory_allocated
    max_memory_cached = max_memory_allocated

    def memory_stats(self, device_index: Index = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._max_rss}

    def total_memory(self, device_index: Index = None) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: Index = None) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        return tensor  # nothing to pin for: the host is the device (as DeepSpeed's CPU accelerator)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 (DeepSpeed's class name)
    """A CUDA GPU: each method is torch.cuda's."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device(self, device_index: Index = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: Any) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: Index = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return torch.cuda.get_device_capability()[0] >= 7  # DeepSpeed's rule: fp16 from Volta on

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)  # torch's own helper, as DeepSpeed's

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device_index: Index = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: Index = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: Index = None) -> torch.Generator:
        return torch.cuda.default_generators[torch.cuda.current_device() if device_index is None else device_index]

    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Index = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Index = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Index = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Index = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: Index = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_reserved(self, device_index: Index = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    memory_cached = memory_reserved

    def max_memory_reserved(self, device_index: Index = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: Index = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: Index = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: Index = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


Accelerator = Union["CPU_Accelerator", "CUDA_Accelerator"]
_ACCELERATOR: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """The CUDA accelerator when torch sees a GPU, else the CPU one (the engine's own choice of
    device, engine.distributed.env); made once per process."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = CUDA_Accelerator() if torch.cuda.is_available() else CPU_Accelerator()
    return _ACCELERATOR


def set_accelerator(accel_obj: Any) -> None:
    """DeepSpeed's: choose the accelerator. Only the engine's own CPU / CUDA accelerators are
    accepted (the engine runs on nothing else); CUDA only where torch sees a GPU."""
    global _ACCELERATOR
    if not isinstance(accel_obj, (CPU_Accelerator, CUDA_Accelerator)):
        raise UnsupportedFeatureError(f"set_accelerator({type(accel_obj).__name__}) is not supported by this engine: "
                                      "it runs on CPU or CUDA only; pass CPU_Accelerator() or CUDA_Accelerator() "
                                      "from engine.compat.deepspeed.accelerator.real_accelerator")
    if isinstance(accel_obj, CUDA_Accelerator) and not torch.cuda.is_available():
        raise RuntimeError("set_accelerator(CUDA_Accelerator()) but torch sees no CUDA device")
    _ACCELERATOR = accel_obj


def is_current_accelerator_supported() -> bool:
    return True
