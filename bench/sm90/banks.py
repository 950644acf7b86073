"""Shared-memory bank conflicts read off the SASS: the 32 lanes' addresses of every shared access whose
address the lane index decides, by running the integer instructions that form it for the lanes of
warp 0 (threadIdx.x 0..31), and the wavefronts each access then takes.

Values: a register holds the 32 lanes' 32-bit values (a tuple), UNI (the same unknown value in every
lane: uniform registers, the constant bank, block indices) or None (unknown, lane by lane: loaded
data, predicates, the high words of 64-bit arithmetic). A uniform unknown added to, subtracted from or
xor'ed with lane values is taken as 0: that shifts every lane's bank alike and leaves the conflicts as
they are; a product of lane values and a uniform unknown is unknown. The program runs once in order
(loops once, both sides of a branch), as sass.simulate reads it.

Wavefronts of one warp's access (bank = 4-byte word mod 32; a wavefront serves one word per bank):
LDS / STS / ATOMS of w bytes a lane go in phases of 128 / w lanes (one for 1-4 bytes), each phase
taking the most distinct words any bank holds among its lanes (at least 1); LDSM / STSM in one phase
per 8 x 8 matrix, its 8 row addresses (16 bytes each) from lanes 8m .. 8m + 7. The conflict-free count
(sass.smem_wavefronts) is the number of phases."""
import re

UNI = "uniform"
LANES = 32
MASK = 0xFFFFFFFF
_IMM = re.compile(r"-?0x[0-9a-f]+|-?\d+")


def _lanes(f, *xs):
    return tuple(f(*v) & MASK for v in zip(*xs))


def _const(v):
    return (v & MASK,) * LANES


def _operand(text, regs):
    """The value of one source operand: a register (R / UR, with .reuse and the like, '-' negated, '~'
    inverted), an immediate, RZ / URZ / PT, the constant bank (UNI)."""
    t = text.strip()
    neg = t.startswith("-")
    inv = t.startswith("~")
    t = t.lstrip("-~").split(".")[0] if re.match(r"[-~]?U?R", t) else t.lstrip("-~")
    if t in ("RZ", "URZ", "SRZ"):
        v = _const(0)
    elif t.startswith("c["):
        v = UNI
    elif re.fullmatch(r"UR\d+", t):
        v = regs.get(t, UNI)
    elif re.fullmatch(r"R\d+", t):
        v = regs.get(t)
    elif _IMM.fullmatch(t):
        v = _const(int(t, 0))
    else:
        return None
    if v is None or v == UNI:
        return v
    if neg:
        v = _lanes(lambda a: -a, v)
    if inv:
        v = _lanes(lambda a: ~a, v)
    return v


def _combine(f, vals, linear):
    """f over the lanes of vals; UNI as 0 where `linear` (sums, xor: the bank shift of a uniform offset),
    else a UNI operand beside lane values makes the result unknown; all-UNI gives UNI."""
    if any(v is None for v in vals):
        return None
    if all(v == UNI for v in vals):
        return UNI
    if any(v == UNI for v in vals):
        if not linear:
            return None
        vals = [_const(0) if v == UNI else v for v in vals]
    return _lanes(f, *vals)


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        i = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> i) & 1) << bit
    return out


def _eval(op, ops, regs):
    """The destination value of one integer instruction (op without its guard; ops: its operand
    texts, the destination and any predicate operands removed), or None."""
    base = op.split(".")[0]
    v = [_operand(x, regs) for x in ops]
    if base == "IMAD" and not any(s in op for s in (".HI", ".X")):
        if len(v) < 3 or v[0] is None or v[1] is None:
            return None
        a, b, c = v[:3]
        if UNI in (a, b):
            other = b if a == UNI else a
            if other != UNI and len(set(other)) > 1:
                return None       # a lane value times an unknown stride
            return _combine(lambda z: z, [c], True) if c != UNI else UNI
        return _combine(lambda x, y, z: x * y + z, [a, b, c], True)
    if base in ("VIADD", "IADD3") and ".X" not in op:
        return _combine(lambda *x: sum(x), v, True) if v else None
    if base == "LOP3" and len(v) >= 4 and v[3] not in (None, UNI):
        lut = v[3][0] & 0xFF
        linear = lut in (0x96, 0x3C, 0x5A, 0x66, 0xFC, 0xFE, 0xEE, 0xFA)   # xor / or forms
        return _combine(lambda a, b, c: _lop3(a, b, c, lut), v[:3], linear)
    if base == "LEA" and ".X" not in op and len(v) >= 3 and v[-1] not in (None, UNI):
        sh = v[-1][0]
        if ".HI" in op:
            if len(v) < 4:
                return None
            return _combine(lambda a, b, c: b + ((a >> (32 - sh)) | (c << sh)), v[:3], True)
        return _combine(lambda a, b: (a << sh) + b, v[:2], True)
    if base == "SHF" and len(v) >= 3 and v[1] not in (None, UNI):
        sh = v[1][0] & 31
        if op.startswith("SHF.R.U32.HI") or op.startswith("SHF.R.S32.HI"):
            signed = ".S32" in op
            return _combine(lambda x: ((x - (1 << 32) if signed and x >> 31 else x) >> sh), [v[2]], False)
        if op.startswith("SHF.L.U32") and ".HI" not in op:
            return _combine(lambda x: x << sh, [v[0]], False)
        if op.startswith("SHF.L.U64.HI"):
            return _combine(lambda a, b: (b << sh) | (a >> (32 - sh) if sh else 0), [v[0], v[2]], False)
        if op.startswith("SHF.R.U64") and ".HI" not in op:
            return _combine(lambda a, b: (a >> sh) | (b << (32 - sh) if sh else 0), [v[0], v[2]], False)
        return None
    if base == "SGXT" and len(v) >= 2 and v[1] not in (None, UNI):
        n = v[1][0]
        signed = ".U32" not in op
        return _combine(lambda x: ((x & ((1 << n) - 1)) - ((1 << n) if signed and (x >> (n - 1)) & 1 else 0)),
                        [v[0]], False)
    if base in ("MOV", "UMOV") and v:
        return v[0]
    if base in ("CS2R",) and ops and ops[0].strip() == "SRZ":
        return _const(0)
    return None


_PRED = re.compile(r"!?U?P(?:\d|T)$")


def run(prog):
    """{index in prog: (lanes' byte addresses relative to the access's uniform base, bytes a lane)} of
    every shared access whose address runs here, warp 0."""
    regs, out = {}, {}
    for i, x in enumerate(prog):
        op = x.op
        parts = [p.strip() for p in x.rest.split(",")] if x.rest else []
        if op.startswith(("LDS", "STS", "LDSM", "STSM", "ATOMS")):
            mem = next((p for p in parts if p.startswith("[")), None)
            addr = _address(mem, regs) if mem else None
            if addr is not None:
                out[i] = addr
        if op.startswith("S2R"):
            sr = parts[1] if len(parts) > 1 else ""
            regs[parts[0]] = tuple(range(LANES)) if sr in ("SR_TID.X", "SR_LANEID") else UNI
            continue
        if x.dest and (all(r.startswith("U") for r in x.dest) or op.startswith("LDC")):
            for r in x.dest:        # uniform results, and constant-bank loads
                regs[r] = UNI
            continue
        if not x.dest:
            continue
        srcs = [p for p in parts[1:] if not _PRED.match(p)]
        if op.startswith(("IADD3", "LEA", "LOP3")) and len(parts) > 1 and _PRED.match(parts[1]):
            srcs = [p for p in parts[2:] if not _PRED.match(p)]
        if op.startswith("CS2R"):
            srcs = parts[1:]
        val = _eval(op, srcs, regs)
        for k, r in enumerate(x.dest):
            if not r.startswith(("P", "UP")):
                regs[r] = val if k == 0 else None
        if op.startswith("CS2R") and val is not None:      # a 64-bit zero: the next register too
            regs["R%d" % (int(x.dest[0][1:]) + 1)] = val
    return out


def _address(mem, regs):
    inner = mem.strip()[1:-1]
    lane = None
    for term in inner.split("+"):
        t = term.strip()
        if re.match(r"R\d+", t):
            lane = regs.get(t.split(".")[0])
            if t.split(".")[-1] == "X4" and lane not in (None, UNI):
                lane = _lanes(lambda a: a * 4, lane)
        elif re.match(r"UR\d+|URZ|RZ|-?0x|\d", t):
            continue
        else:
            return None
    if lane is None:
        return None
    return _const(0) if lane == UNI else lane


def wavefronts(op, addr):
    """One warp's wavefronts for `op` at the lanes' byte addresses `addr`."""
    if op.startswith(("LDSM", "STSM")):
        m = re.search(r"\.(\d)$", op)
        phases = [list(range(8 * p, 8 * p + 8)) for p in range(int(m.group(1)) if m else 1)]
        words = 4
    else:
        m = re.search(r"\.(128|64)(?:\.|$)", op)
        width = {"128": 16, "64": 8}[m.group(1)] if m else 4
        per = 128 // width
        phases = [list(range(p, p + per)) for p in range(0, LANES, per)]
        words = width // 4
    total = 0
    for lanes in phases:
        banks = {}
        for ln in lanes:
            for w in range(words):
                word = (addr[ln] >> 2) + w
                banks.setdefault(word % 32, set()).add(word)
        total += max((len(s) for s in banks.values()), default=1)
    return float(total)


def conflict_wavefronts(prog):
    """{index in prog: wavefronts} of the shared accesses whose addresses run here (the others are absent:
    sass.smem_wavefronts' conflict-free count applies)."""
    return {i: wavefronts(prog[i].op, a) for i, a in run(prog).items()}

