"""The H200 (sm_90) as the inspector and its model see it: every device constant in one place, and
fake_hopper(), which makes triton's driver and torch.cuda's device queries answer as one H200."""
import contextlib
import types
from unittest import mock

SM90_TARGET = ("cuda", 90, 32)      # NVIDIA warps are 32 threads
NAME = "NVIDIA H200"
NUM_SMS = 132
CLOCK_HZ = 1.98e9                   # SM boost clock
HBM_BPS = 4.3e12                    # measured device copy bandwidth of the H200 (docs/DESIGN.md section 8)
TC_FLOPS = {"bf16": 790e12, "f16": 790e12, "f32": 395e12}    # dense bf16 measured; tf32 is half
SM_BPS = 64 * CLOCK_HZ              # what one SM takes from L2: 64 bytes a cycle
REGS_PER_SM = 65536
SMEM_PER_SM = 233472                # 228 KB
SMEM_PER_CTA = 232448               # 227 KB: the opt-in maximum of one CTA
SMEM_PER_CTA_DEFAULT = 49152
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
MEM_CLOCK_KHZ = 3201000
MEM_BUS_BITS = 6144
TOTAL_MEMORY = 141 * 2**30


class _FakeUtils:
    @staticmethod
    def get_device_properties(_device=0):
        return dict(multiprocessor_count=NUM_SMS, max_shared_mem=SMEM_PER_CTA, max_num_regs=REGS_PER_SM,
                    warpSize=SM90_TARGET[2], sm_clock_rate=int(CLOCK_HZ / 1000), mem_clock_rate=MEM_CLOCK_KHZ,
                    mem_bus_width=MEM_BUS_BITS)


class _FakeDriver:
    """What triton.runtime.driver.active answers on one H200; nothing here can launch."""
    utils = _FakeUtils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(*SM90_TARGET)

    def get_current_device(self):
        return 0

    def get_current_stream(self, _device=None):
        return 0

    def get_device_interface(self):
        import torch
        return torch.cuda

    def is_active(self):
        return True


@contextlib.contextmanager
def fake_hopper():
    """Triton's driver and torch.cuda's device queries answer as one H200 (sm_90, 132 SMs)."""
    import torch
    from triton.runtime import driver
    props = types.SimpleNamespace(name=NAME, major=9, minor=0, multi_processor_count=NUM_SMS,
                                  shared_memory_per_block=SMEM_PER_CTA_DEFAULT,
                                  shared_memory_per_block_optin=SMEM_PER_CTA, total_memory=TOTAL_MEMORY,
                                  warp_size=SM90_TARGET[2])
    old = driver._active
    driver.set_active(_FakeDriver())
    patches = [mock.patch.object(torch.cuda, name, value) for name, value in dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_capability=lambda *_: (9, 0), get_device_name=lambda *_: props.name,
        get_device_properties=lambda *_: props, device=lambda *_: contextlib.nullcontext(),
        current_stream=lambda *_: types.SimpleNamespace(cuda_stream=0)).items()]
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield
    finally:
        driver._active = old
