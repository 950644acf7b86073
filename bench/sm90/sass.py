"""Reading cuobjdump's SASS: the instructions and the per-iteration counts of the sequential chunk loop."""
import math
import re

_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def sass_instructions(sass):
    """[(address, opcode with modifiers, operands)] of cuobjdump's SASS text."""
    return [(int(a, 16), op, rest.strip()) for a, op, rest in _SASS.findall(sass or "")]


def sass_loop(ins):
    """Per-iteration counts of the widest loop (a backward branch) whose body holds a tensor-core MMA
    (HGMMA: warpgroup MMA; HMMA: a warp's mma.sync, what Triton emits with fewer than 4 warps), inner
    loops counted once: HGMMA, HMMA, instructions (NOPs left out), wgmma waits, CTA barriers, conversions
    to bf16/fp16 (F2FP), and mma_cycles, the tensor-pipe issue cycles of those MMAs (HGMMA 64xNxk: N/2;
    HMMA m16n8k16: 8, m16n8k8: 4). {} when no loop holds one. A backward branch placed after the
    kernel's last EXIT is not a loop: it returns from an out-of-line slow path (ptxas moves an mbarrier
    try-wait's retry, e.g. of a TMA load, to the end of the kernel) to the instruction after the wait."""
    best = None
    last_exit = max((a for a, op, _ in ins if op == "EXIT"), default=math.inf)
    for a, op, rest in ins:
        m = re.match(r"(0x[0-9a-f]+)", rest)
        if op == "BRA" and m and int(m.group(1), 16) < a < last_exit:
            lo = int(m.group(1), 16)
            body = [o for x, o, _ in ins if lo <= x <= a]
            if any(o.startswith(("HGMMA", "HMMA")) for o in body) and (best is None or a - lo > best[0]):
                best = (a - lo, body)
    if best is None:
        return {}
    body = best[1]
    cycles = 0.0
    for o in body:
        m = re.match(r"HGMMA\.64x(\d+)x", o)
        cycles += int(m.group(1)) / 2 if m else 8 if o.startswith("HMMA.16816") else 4 if o.startswith("HMMA") else 0
    return dict(mma_cycles=cycles, hgmma=sum(o.startswith("HGMMA") for o in body),
                hmma=sum(o.startswith("HMMA") for o in body), instr=sum(not o.startswith("NOP") for o in body),
                waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in body),
                bars=sum(o.startswith("BAR.") for o in body), f2fp=sum(o.startswith("F2FP") for o in body))


