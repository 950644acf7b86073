"""Reading cuobjdump's SASS: the instructions, the per-iteration counts of the sequential chunk loop, and
the critical path of one warp through the kernel (simulate)."""
import dataclasses
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
    to bf16/fp16 (F2FP), and mma_cycles, the tensor-pipe cycles of those MMAs (HGMMA: hgmma_cycles;
    HMMA m16n8k16: 8, m16n8k8: 4). {} when no loop holds one. A backward branch placed after the
    kernel's last EXIT is not a loop: it returns from an out-of-line slow path (ptxas moves an mbarrier
    try-wait's retry, e.g. of a TMA load, to the end of the kernel) to the instruction after the wait."""
    best = None
    last_exit = max((a for a, op, _ in ins if op == "EXIT"), default=math.inf)
    for a, op, rest in ins:
        m = re.match(r"(0x[0-9a-f]+)", rest)
        if op == "BRA" and m and int(m.group(1), 16) < a < last_exit:
            lo = int(m.group(1), 16)
            body = [(o, r) for x, o, r in ins if lo <= x <= a]
            if any(o.startswith(("HGMMA", "HMMA")) for o, _ in body) and (best is None or a - lo > best[0]):
                best = (a - lo, body)
    if best is None:
        return {}
    body = best[1]
    cycles = sum(hgmma_cycles(o, r) if o.startswith("HGMMA") else 8 if o.startswith("HMMA.16816") else
                 4 if o.startswith("HMMA") else 0 for o, r in body)
    body = [o for o, _ in body]
    return dict(mma_cycles=cycles, hgmma=sum(o.startswith("HGMMA") for o in body),
                hmma=sum(o.startswith("HMMA") for o in body), instr=sum(not o.startswith("NOP") for o in body),
                waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in body),
                bars=sum(o.startswith("BAR.") for o in body), f2fp=sum(o.startswith("F2FP") for o in body))



# ---------------------------------------------------------------- the critical path of one warp

@dataclasses.dataclass(frozen=True)
class Latencies:
    """Cycles from an instruction's issue to its result: the model's constants. bar is fitted on FLA's
    published H200 times (model.FIT, validate.py; bench/NOTES.md), the others fixed; ldg, hgmma (with
    hgmma_cycles) and smem come from published Hopper microbenchmarks (Luo et al., "Benchmarking and
    Dissecting the Nvidia Hopper GPU Architecture", IPDPS 2024, arXiv 2402.13499: H800 tables IV, VII
    and VIII)."""
    alu: float = 4.0        # integer / fp32 pipes, dependent issue
    xu: float = 12.0        # conversions (F2F, I2F, F2I, FRND) and MUFU (EX2, RCP, ...)
    smem: float = 30.0      # LDS / LDSM / SHFL: a shared-memory round trip (Luo et al. table IV: 29.0)
    ldg: float = 478.8      # a global load (LDG, cp.async, TMA) from issue to data (Luo et al. table IV; not fitted)
    # a warpgroup-MMA group's completion after the tensor pipe is done with it (hgmma_cycles): not fitted.
    # The published wgmma latencies (Luo et al. table VIII, m64n256k16: 128 cycles; Jarmusch and
    # Chandrasekaran, arXiv 2512.02189, H200: m64n64k16 32, m64n128k16 64, m64n256k16 128) are chains of
    # accumulating wgmmas: they equal the pipe's N / 2 and hide the fixed part. That part is put together
    # from the same measurements: the group's first operand fetch from shared memory (29 cycles, table
    # IV), which a chain overlaps with the previous wgmma, plus the accumulate and write-back after the
    # last MMA (mma.sync m16n8k16: 24.1 cycles of completion latency, table VII, less its 4 pipe
    # cycles): 29 + 20 ~ 50. How ours / FLA moves with it: bench/NOTES.md, "wgmma latency".
    hgmma: float = 50.0
    hmma: float = 32.0      # mma.sync
    bar: float = 51.0       # a CTA barrier (BAR.SYNC) once every warp has arrived (fitted)


_FULL = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_NO_DEST = ("ST", "RED", "BAR", "BRA", "EXIT", "LDGSTS", "LDGDEPBAR", "DEPBAR", "WARPGROUP", "NOP", "MEMBAR",
            "FENCE", "ERRBAR", "CCTL", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "YIELD", "UTMA", "UBLKCP",
            "SYNCS", "ARRIVES", "USTG")
_REG = re.compile(r"(?<![\w.])(UR|R|UP|P)(\d+)(?:\.(64|128))?")


def _regs(text, width=1):
    """Register names in an operand text; R4.64 is R4, R5; `width` registers from a bare base register."""
    out = []
    for kind, n, w in _REG.findall(text):
        k = 1 if kind in ("P", "UP") else {"64": 2, "128": 4}.get(w, width)
        out += [f"{kind}{int(n) + i}" for i in range(k)]
    return out


def _dest_width(op):
    """Registers an instruction writes from its destination's base register."""
    m = re.match(r"HGMMA\.64x(\d+)x\d+\.(F32|F16)", op)
    if m:
        return int(m.group(1)) // (2 if m.group(2) == "F32" else 4)
    if op.startswith("HMMA"):
        return 4 if ".F32" in op else 2
    if op.startswith("LDSM"):
        last = op.rsplit(".", 1)[-1]
        return int(last) if last.isdigit() else 1
    return 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1


@dataclasses.dataclass
class Instr:
    addr: int
    guarded: bool           # has a predicate guard (@P0 ...)
    op: str
    rest: str               # operands
    dest: list
    src: list

    @property
    def target(self):
        """A branch's target address, else None."""
        m = re.match(r"(0x[0-9a-f]+)", self.rest) if self.op == "BRA" else None
        return int(m.group(1), 16) if m else None


def program(sass):
    """[Instr] of cuobjdump's SASS text. The first operand is the destination of every op that has one
    (a second operand that is a bare predicate too: carry-outs, ISETP's second result); every other
    register named, addresses and the predicate guard included, is a source."""
    out = []
    for a, guard, op, rest in _FULL.findall(sass or ""):
        rest = rest.strip()
        parts = [p.strip() for p in rest.split(",")] if rest else []
        dest, n = [], 0
        if parts and not op.startswith(_NO_DEST):
            dest, n = _regs(parts[0], _dest_width(op)), 1
            if len(parts) > 1 and re.fullmatch(r"U?P\d", parts[1]):
                dest, n = dest + [parts[1]], 2
        src = _regs(", ".join(parts[n:])) + _regs(guard)
        if op.startswith("HGMMA"):     # the accumulator chains inside the tensor pipe, not through the warp
            src = [r for r in src if not r.startswith("R")]
        out.append(Instr(int(a, 16), bool(guard), op, rest, dest, src))
    return out


def loop_tree(prog):
    """The executed path as a tree: a list of instruction indices and loops (first, last, body), a loop
    being the instructions from a backward branch's target to the branch (branches after the last EXIT
    excepted, see sass_loop), a loop inside another one its child. An unguarded forward branch is taken
    (the code it jumps over is not on the path); a guarded one falls through (both sides are counted)."""
    last_exit = max((x.addr for x in prog if x.op == "EXIT"), default=math.inf)
    index = {x.addr: i for i, x in enumerate(prog)}
    spans = [(index[x.target], j) for j, x in enumerate(prog)
             if x.target is not None and x.target < x.addr < last_exit and x.target in index]

    def body(lo, hi, outer):
        out, i = [], lo
        while i <= hi:
            here = [e for b, e in spans if b == i and e <= hi and (b, e) != outer]
            if here:
                e = max(here)
                out.append((i, e, body(i, e, (i, e))))
                i = e + 1
                continue
            x = prog[i]
            out.append(i)
            if x.op == "EXIT" and not x.guarded:
                break
            if x.op == "BRA" and not x.guarded and x.target is not None and x.target > x.addr:
                i = index.get(x.target, hi + 1)
                continue
            i += 1
        return out

    return body(0, len(prog) - 1, None)


SMEM_BYTES_PER_CYCLE = 128     # what an SM's shared memory feeds its tensor cores a cycle
_ESIZE = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1}


def hgmma_cycles(op, rest=""):
    """Tensor-pipe cycles of one warpgroup MMA (HGMMA.64xNxK.<acc>.<type>; rest: its operands): the
    larger of its FLOPs at the SM's dense rate, N / 2 cycles for every 64 x N x (32 bytes of K) shape
    (bf16 / fp16 K = 16, tf32 K = 8, fp8 K = 32), and its operands' bytes from shared memory at 128 B a
    cycle: B (N x K) always, A (64 x K) too when it comes from shared memory (SS: the first operand a
    descriptor, gdesc) rather than from registers (RS). SS and RS are equal from N = 64 and SS is slower
    below (16 + N / 4 cycles): what Luo et al. (arXiv 2501.12084, the extended version) measure, and
    the same arithmetic gives their sparse m64n256k32 (SS 144, RS 128 cycles)."""
    m = re.match(r"HGMMA\.64x(\d+)x", op)
    return max(int(m.group(1)) / 2, hgmma_smem_cycles(op, rest)) if m else 0.0


def hgmma_smem_cycles(op, rest=""):
    """Cycles of a warpgroup MMA's operand reads from shared memory at 128 B a cycle: B (N x K), and A
    (64 x K) when it is a descriptor (SS) rather than registers (RS); 0 for other instructions."""
    m = re.match(r"HGMMA\.64x(\d+)x(\d+)\.\w+(?:\.(\w+))?", op)     # fp16 inputs carry no type suffix
    if not m:
        return 0.0
    n, k, esize = int(m.group(1)), int(m.group(2)), _ESIZE.get(m.group(3) or "F16", 2)
    ss = rest.split(",")[1].strip().startswith("gdesc") if rest.count(",") >= 1 else True
    return (n * k + (64 * k if ss else 0)) * esize / SMEM_BYTES_PER_CYCLE


_MEMORY = ("LDG", "LD.", "STG", "ST.", "ATOM", "RED", "LDS", "STS")
# 1- and 2-byte global accesses (LDG / STG .U8 / .S8 / .U16 / .S16): an element-wise tile access the compiler
# did not vectorise (triton 3.6.0 compiled every tile access through a reshaped arange this way in the
# kernels an H200 ran at 5-12x the model; bench/NOTES.md, "First GPU run")
NARROW_GLOBAL = re.compile(r"(?:LDG|STG)\.E(?:\.\w+)*?\.(?:U8|S8|U16|S16)(?:\.\w+)*$")
_SHARED = ("LDS", "STS", "ATOMS")
_WIDTH = {"128": 16, "64": 8}


def smem_wavefronts(op):
    """Shared-memory cycles of one warp's instruction at one 128-byte wavefront a cycle (the SM's shared
    memory bandwidth, bank conflicts not counted): LDS / STS / ATOMS / LDGSTS by their width (32 lanes x 4,
    8 or 16 bytes: 1, 2 or 4), LDSM / STSM by their matrices (.x1 / .x2 / .x4: one 128-byte 8 x 8 matrix
    each), SHFL one (a shuffle crosses the lanes through the same data path: counted so, the H200's
    L1-busy time of prep, dq and dk is 0.73-0.84 of this term, without them 0.27-0.78; bench/NOTES.md
    "The second H200 session"), MOVM (movmatrix: one 8 x 8 matrix across the lanes) one, as a shuffle;
    0 for the others. A warpgroup MMA's operand reads are `hgmma_smem_cycles`."""
    if op.startswith(("SHFL", "MOVM")):
        return 1.0
    if op.startswith(("LDSM", "STSM")):
        m = re.search(r"\.(\d)$", op)
        return float(m.group(1)) if m else 1.0
    if op.startswith(("LDS", "STS", "ATOMS", "LDGSTS")):
        m = re.search(r"\.(128|64)(?:\.|$)", op)
        return 32.0 * (_WIDTH[m.group(1)] if m else 4) / SMEM_BYTES_PER_CYCLE
    return 0.0


def simulate(prog, trips, lat, cap=3, wavefronts=None):
    """One warp's in-order issue of the path of loop_tree(prog), one instruction a cycle at most, each
    waiting for its source registers: {"cycles", "instr", "mma_cycles"} for the whole kernel, loops
    run trips(i, loop) times (i: the loop's index among all loops in program order). Results are ready
    at issue + their latency (Latencies); cp.async groups (LDGSTS ... LDGDEPBAR) land ldg cycles after
    their last load and DEPBAR.LE SB0, n waits for all but the n newest; warpgroup MMAs run one after
    the other on the tensor pipe (hgmma_cycles each), a group (up to the one marked gsb0) is
    done hgmma cycles after the pipe finishes it, and WARPGROUP.DEPBAR.LE gsb0, n waits for all but
    the n newest groups; TMA loads (UTMALDG, UBLKCP) land ldg cycles after issue and an mbarrier wait
    (SYNCS.PHASECHK) waits for the oldest one; BAR.SYNC costs bar cycles; a MEMBAR waits for the
    warp's loads and stores in flight (shared: smem, global: ldg cycles after issue; not cp.async or
    TMA, which complete through their own waits). A loop runs at most `cap`
    iterations; the rest are charged at the last simulated iteration's cycles and instructions. "stalls":
    the cycles the warp waited, by what it waited for (wgmma, global, shared, barrier, alu, xu, mma);
    "narrow": the warp's 1-2 byte global accesses (NARROW_GLOBAL), loops counted like instructions;
    "smem": the warp's shared-memory wavefronts (`wavefronts`, {index in prog: wavefronts} with bank
    conflicts where known, banks.conflict_wavefronts; else smem_wavefronts, conflict-free) and
    "smem_mma" its warpgroup MMAs' operand reads (hgmma_smem_cycles, once for the warpgroup), in cycles
    of the SM's shared memory."""
    tree = loop_tree(prog)
    st = dict(t=0.0, extra=0.0, instr=0.0, extra_instr=0.0, mma=0.0, extra_mma=0.0, pipe=0.0, cp_open=0.0,
              wg_open=0.0, mem=0.0, narrow=0.0, extra_narrow=0.0, smem=0.0, extra_smem=0.0, smem_mma=0.0,
              extra_smem_mma=0.0)
    counted = ("narrow", "smem", "smem_mma")
    ready, cp_groups, wg_groups, tma, stalls = {}, [], [], [], {}
    loop_no = [0]

    wavefronts = wavefronts or {}

    def issue(x, i):
        t0 = st["t"] + 1.0
        src = [ready.get(r, (0.0, "")) for r in x.src]
        t, cause = max([(t0, "")] + src)
        op = x.op
        if op.startswith("HGMMA"):
            start = max(t, st["pipe"])
            st["pipe"] = start + hgmma_cycles(op, x.rest)
            st["mma"] += hgmma_cycles(op, x.rest)
            st["wg_open"] = st["pipe"] + lat.hgmma
            for r in x.dest:
                ready[r] = (st["wg_open"], "wgmma")
            if "gsb0" in x.rest:
                wg_groups.append(st["wg_open"])
        elif op.startswith("WARPGROUP.DEPBAR"):
            n = int(x.rest.rsplit(",", 1)[-1], 16) if "," in x.rest else 0
            if len(wg_groups) > n and wg_groups[-n - 1] > t:
                t, cause = wg_groups[-n - 1], "wgmma"
        elif op.startswith("LDGSTS"):
            st["cp_open"] = max(st["cp_open"], t + lat.ldg)
        elif op.startswith("LDGDEPBAR"):
            cp_groups.append(max(st["cp_open"], t))
            st["cp_open"] = 0.0
        elif op.startswith("DEPBAR"):
            m = re.search(r"SB0,\s*(0x[0-9a-f]+|\d+)", x.rest)
            n = int(m.group(1), 0) if m else 0
            if m and len(cp_groups) > n and cp_groups[-n - 1] > t:
                t, cause = cp_groups[-n - 1], "global"
        elif op.startswith(("UTMALDG", "UBLKCP")):
            tma.append(t + lat.ldg)
        elif op.startswith("SYNCS.PHASECHK"):
            if tma and tma[0] > t:
                t, cause = tma.pop(0), "global"
            elif tma:
                tma.pop(0)
        elif op.startswith("BAR."):
            t, cause = t + lat.bar, "barrier"
        elif op.startswith("MEMBAR"):
            if st["mem"] > t:
                t, cause = st["mem"], "fence"
        elif op.startswith("HMMA"):
            st["mma"] += 8.0 if op.startswith("HMMA.16816") else 4.0
            for r in x.dest:
                ready[r] = (t + lat.hmma, "mma")
        else:
            kind = ("global" if op.startswith(("LDG", "LD.", "ATOMG", "ATOM.")) or op == "LD" else
                    "shared" if op.startswith(("LDS", "SHFL", "MOVM", "ATOMS", "S2R", "LDC")) else
                    "xu" if op.startswith(("F2F", "I2F", "F2I", "FRND", "MUFU", "I2I")) else "alu")
            d = {"global": lat.ldg, "shared": lat.smem, "xu": lat.xu, "alu": lat.alu}[kind]
            for r in x.dest:
                ready[r] = (t + d, kind)
            if op.startswith(_MEMORY):      # what a MEMBAR waits for
                st["mem"] = max(st["mem"], t + (lat.smem if op.startswith(_SHARED) else lat.ldg))
        if t > t0:
            stalls[cause] = stalls.get(cause, 0.0) + t - t0
        st["t"] = t
        if not op.startswith("NOP"):
            st["instr"] += 1.0
        if NARROW_GLOBAL.match(op):
            st["narrow"] += 1.0
        st["smem"] += wavefronts.get(i, smem_wavefronts(op))
        st["smem_mma"] += hgmma_smem_cycles(op, x.rest)

    def run(nodes):
        for node in nodes:
            if isinstance(node, int):
                issue(prog[node], node)
                continue
            first, last, inner = node
            k = loop_no[0]
            loop_no[0] += 1
            n = max(0, int(trips(k, node)))
            before = None
            for _ in range(min(n, cap)):
                before = (st["t"] + st["extra"], st["instr"] + st["extra_instr"], st["mma"] + st["extra_mma"],
                          dict(stalls), {c: st[c] + st["extra_" + c] for c in counted})
                mark = loop_no[0]
                loop_no[0] = k + 1
                run(inner)
                loop_no[0] = max(loop_no[0], mark)
            if n > cap and before is not None:
                st["extra"] += (n - cap) * (st["t"] + st["extra"] - before[0])
                st["extra_instr"] += (n - cap) * (st["instr"] + st["extra_instr"] - before[1])
                st["extra_mma"] += (n - cap) * (st["mma"] + st["extra_mma"] - before[2])
                for c in counted:
                    st["extra_" + c] += (n - cap) * (st[c] + st["extra_" + c] - before[4][c])
                for k, v in list(stalls.items()):
                    stalls[k] = v + (n - cap) * (v - before[3].get(k, 0.0))
            if n == 0:
                loop_no[0] = k + 1 + _count_loops(inner)

    run(tree)
    end = max([st["t"]] + cp_groups + wg_groups)
    return dict(cycles=end + st["extra"], instr=st["instr"] + st["extra_instr"], mma_cycles=st["mma"] + st["extra_mma"],
                stalls=stalls, **{c: st[c] + st["extra_" + c] for c in counted})


def _count_loops(nodes):
    return sum(1 + _count_loops(n[2]) for n in nodes if not isinstance(n, int))


def loops_in_order(prog):
    """[(first, last, holds an MMA, depth)] of every loop of loop_tree(prog), in the order simulate
    numbers them; depth: the loops around it."""
    out = []

    def walk(nodes, depth):
        for n in nodes:
            if not isinstance(n, int):
                out.append((n[0], n[1], any(prog[i].op.startswith(("HGMMA", "HMMA")) for i in range(n[0], n[1] + 1)),
                            depth))
                walk(n[2], depth + 1)
    walk(loop_tree(prog), 0)
    return out
