"""Reading the TTIR of a compiled kernel: per-program FLOPs, tile bytes, the dots and the loops' trip counts."""
import math
import re

_ESIZE = {"i1": 1, "i8": 1, "bf16": 2, "f16": 2, "i16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8,
          "f8E4M3FN": 1, "f8E5M2": 1}
_INT_OPS = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
            "divsi": lambda a, b: int(a / b), "divui": lambda a, b: a // b, "floordivsi": lambda a, b: a // b,
            "ceildivsi": lambda a, b: -(-a // b), "remsi": lambda a, b: int(math.fmod(a, b)),
            "remui": lambda a, b: a % b, "minsi": min, "maxsi": max, "minui": min, "maxui": max}
_TYPE = r"(?:tensor<([0-9x]+)x(?:!tt\.ptr<)?(\w+)>?>|!tt\.ptr<(?:tensor<([0-9x]+)x)?(\w+)>?>)"


def _tile_bytes(type_text):
    """Bytes of one tile of an IR type: tensor<64x32x!tt.ptr<bf16>>, !tt.ptr<i32>, tensor<64x32xbf16>."""
    m = re.search(_TYPE, type_text)
    if not m:
        return 0
    shape, elem = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
    n = math.prod(int(x) for x in shape.split("x")) if shape else 1
    return n * _ESIZE.get(elem, 4)


def _ir_tree(text):
    """Nested blocks of the TTIR function body: {"head": line, "items": [line | block]}."""
    root = {"head": "", "items": []}
    stack = [root]
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("}"):
            if len(stack) > 1:
                stack.pop()
            if not s.endswith("{"):
                continue
            s = "} else {"
        if s.endswith("{"):
            node = {"head": s, "items": []}
            stack[-1]["items"].append(node)
            stack.append(node)
        elif s:
            stack[-1]["items"].append(s)
    return root


def _int_values(text, scalars):
    """SSA integer values computable from constants and the launch's scalar arguments."""
    vals = {f"%{k}": v for k, v in scalars.items() if isinstance(v, int)}
    for s in text.splitlines():
        s = s.strip()
        m = re.match(r"(%[\w.-]+) = arith\.constant (-?\d+) : i\d+", s)
        if m:
            vals[m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"(%[\w.-]+) = arith\.(\w+) (%[\w.#-]+)(?:, (%[\w.#-]+))?", s)
        if not m:
            continue
        name, op, a, b = m.groups()
        if op in _INT_OPS and b and a in vals and b in vals and vals[b] != 0:
            vals[name] = _INT_OPS[op](vals[a], vals[b])
        elif op in ("extsi", "extui", "trunci", "index_cast") and a in vals:
            vals[name] = vals[a]
    return vals


def read_ttir(text, scalars, seq_chunks):
    """Per-program FLOPs (tt.dot: 2 M N K), loaded/stored tile bytes, the dots' operand types and input
    precision, and whether a loop whose trip count is not a compile-time constant holds a dot (the
    sequential chunk loop) and its trip count. Trip counts come from constants and the scalar arguments;
    a loop whose bounds are loaded from memory runs seq_chunks times if it holds a dot (the chunk loop)
    and 0 times if not (padding rows: the report's shapes have none); both branches of an if are counted.
    "loops": every scf.for in program order (outer before inner): its trips per entry, whether it holds a
    dot, whether it is the sequential chunk loop (a dot, bounds not compile-time constants), whether
    its bounds are compile-time constants and its depth (the scf.for loops around it)."""
    vals, consts = _int_values(text, scalars), _int_values(text, {})
    acc = dict(flops=0.0, ld=0.0, st=0.0, seq_loop=False, seq_trips=0, dots=[], loops=[])

    def has_dot(node):
        return any(has_dot(x) if isinstance(x, dict) else " tt.dot " in x for x in node["items"])

    def walk(node, mult, depth=0):
        for x in node["items"]:
            if isinstance(x, dict):
                m = re.search(r"scf\.for %[\w.-]+ = (%[\w.#-]+) to (%[\w.#-]+) step (%[\w.#-]+)", x["head"])
                trips = 1
                if m:
                    lb, ub, st = (vals.get(v) for v in m.groups())
                    if None in (lb, ub, st):
                        trips = seq_chunks if has_dot(x) else 0
                    else:
                        trips = max(0, -(-(ub - lb) // st))
                    seq = has_dot(x) and any(v not in consts for v in m.groups())
                    if seq:
                        acc["seq_loop"], acc["seq_trips"] = True, max(acc["seq_trips"], trips)
                    acc["loops"].append(dict(trips=trips, dot=has_dot(x), seq=seq,
                                             const=all(v in consts for v in m.groups()), depth=depth))
                walk(x, mult * trips, depth + bool(m))
            elif " tt.dot " in x:
                m = re.search(r": tensor<((?:\d+x)+)(\w+)> \* tensor<((?:\d+x)+)(\w+)>", x)
                da, a, db, b = m.groups()       # [batch x] M x K and [batch x] K x N
                *bt, M, K = map(int, da.rstrip("x").split("x"))
                N = int(db.rstrip("x").split("x")[-1])
                acc["flops"] += mult * 2 * math.prod(bt) * M * N * K
                p = re.search(r"inputPrecision = (\w+)", x)
                acc["dots"].append((a, b, p.group(1) if p else "ieee"))
            elif " tt.load " in x or " tt.descriptor_load " in x:
                acc["ld"] += mult * _tile_bytes(x.rsplit(" -> " if "descriptor" in x else " : ", 1)[-1])
            elif x.startswith("tt.store ") or x.startswith("tt.descriptor_store "):
                acc["st"] += mult * _tile_bytes(x.rsplit(" : ", 1)[-1].split(", ")[-1])
            elif " tt.atomic_rmw " in x:
                b = _tile_bytes(x.rsplit(" : ", 1)[-1])
                acc["ld"] += mult * b
                acc["st"] += mult * b

    walk(_ir_tree(text), 1)
    return acc
