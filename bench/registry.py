"""Named benchmark scenarios and suites.

A scenario fixes the data: which op it feeds, the head shape (H qk-heads, HV v-heads, head dims K, V),
the dtype, and the token layout:
  dense    B rows of T tokens, no cu_seqlens (the FLA/FlashQLA comparison shapes)
  varlen   N documents packed into one [1, sum(lengths)] row with cu_seqlens
  packing  documents drawn from a seeded length distribution to fill `micro_batch` rows of `row_len`
           tokens; run twice on the same documents:
             padded = one document per row, right-padded to row_len ([ndocs, row_len], no cu_seqlens:
                      what a padded trainer does today; every pad token is computed)
             packed = the same documents concatenated, [1, sum(lengths)] with cu_seqlens
           ideal ratio = padded tokens / real tokens = ndocs * row_len / sum(lengths)
  decode   N sequences of one token each with an fp32 state per sequence (the recurrent op)

Where the head shapes come from:
  Qwen3-Next-80B-A3B: transformers 5.24 `Qwen3NextConfig()` defaults, documented as that model:
      16 qk heads, 32 v heads, K = V = 128, hidden 2048, conv kernel 4.
  Qwen3.5-35B-A3B: transformers 5.24 `Qwen3_5MoeTextConfig()` defaults (checkpoint Qwen/Qwen3.5-35B-A3B):
      16 / 32 heads, K = V = 128, hidden 2048.
  Qwen3.5-397B-A17B: 16 / 64 heads, K = V = 128, hidden 4096, derived from the cache shapes quoted at
      https://harmonyhu.com/2026/02/21/qwen3.5 (conv state [B, 12288, 4] = 2*16*128 + 64*128 channels,
      recurrent state [B, 64, 128, 128]); not checked against the checkpoint's config.json.
  FLA / FlashQLA / FlashInfer comparison shapes: the shapes those projects publish GDN numbers at
  (1x32768 with 16/32 and 16/64 heads, 2/8 heads at 64k, "1024x8" read as 8 packed sequences of 1024
  tokens, K = V = 128, bf16).
"""
import random
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

LAYOUTS = ("dense", "varlen", "packing", "decode")


@dataclass(frozen=True)
class Scenario:
    op: str                     # gdr | conv | recurrent | layer | hybrid | packing
    layout: str                 # dense | varlen | packing | decode
    H: int
    HV: int
    K: int = 128
    V: int = 128
    dtype: str = "bfloat16"
    B: int = 1                  # dense: rows
    T: int = 0                  # dense: tokens per row; packing: row length
    lengths: Tuple[int, ...] = ()   # varlen / packing: document lengths
    micro_batch: int = 0        # packing: rows of the packed trainer
    doc_mean: int = 0           # packing: mean document length asked for
    seed: int = 0
    hidden: int = 0             # layer / hybrid: model width (0: derived from the heads)
    conv_width: int = 4
    prefix: str = ""            # model family tag in the name (QWEN3NEXT_, ...)
    source: str = ""            # where the shape comes from
    label: str = field(default="", compare=False)   # explicit name (else derived)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        heads = f"H{self.H}x{self.HV}_K{self.K}_V{self.V}"
        if self.layout == "dense":
            core = f"B{self.B}_T{self.T}"
        elif self.layout == "varlen":
            ls = set(self.lengths)
            core = (f"N{len(self.lengths)}_L{self.lengths[0]}" if len(ls) == 1
                    else f"N{len(self.lengths)}_T{sum(self.lengths)}")
        elif self.layout == "packing":
            core = f"PACK_L{self.T}_MB{self.micro_batch}_DOC{self.doc_mean}"
        else:
            core = f"DECODE_N{self.B}"
        width = f"_D{self.hidden}" if self.op in ("layer", "hybrid", "conv") and self.hidden else ""
        return f"{self.prefix}{core}_{heads}{width}"

    @property
    def docs(self) -> Tuple[int, ...]:
        """Real sequence lengths, in packed order."""
        if self.layout == "dense":
            return (self.T,) * self.B
        if self.layout == "decode":
            return (1,) * self.B
        return self.lengths

    @property
    def real_tokens(self) -> int:
        return sum(self.docs)

    @property
    def padded_tokens(self) -> int:
        """Tokens a padded trainer computes (packing: one document per row of row_len)."""
        return len(self.lengths) * self.T if self.layout == "packing" else self.real_tokens

    def rows(self, layout: str) -> Optional[Tuple[int, int]]:
        """(B, L) of the batch the scenario runs as in a layout: dense = its B rows of T tokens, padded =
        one document per row of T tokens; None for packed (one row with cu_seqlens)."""
        return {"dense": (self.B, self.T), "padded": (len(self.docs), self.T)}.get(layout)

    @property
    def width(self) -> int:
        """Model width for layer/hybrid (and the channel count of conv)."""
        return self.hidden or self.HV * self.V

    def scaled(self, s: float) -> "Scenario":
        """The same scenario with every token count multiplied by s (heads and head dims kept)."""
        if s == 1:
            return self
        f = lambda n: max(1, int(round(n * s)))  # noqa: E731
        out = replace(self, T=f(self.T) if self.T else 0, lengths=tuple(f(n) for n in self.lengths),
                      doc_mean=f(self.doc_mean) if self.doc_mean else 0,
                      B=f(self.B) if self.layout == "decode" else self.B)
        if self.label:
            out = replace(out, label=f"{self.label}_s{s:g}")
        return out


def packing_lengths(row_len: int, micro_batch: int, doc_mean: int, seed: int = 0) -> Tuple[int, ...]:
    """Documents (seeded log-normal lengths around doc_mean, clipped to [32, row_len]) drawn until the
    next one no longer fits in micro_batch * row_len tokens; the packed trainer fills its micro-batch
    with exactly these."""
    import math
    rng = random.Random(seed)
    sigma = 0.6
    mu = math.log(doc_mean) - sigma * sigma / 2       # mean of the log-normal = doc_mean
    docs, budget = [], micro_batch * row_len
    while True:
        n = min(row_len, max(32, int(rng.lognormvariate(mu, sigma))))
        if sum(docs) + n > budget:
            return tuple(docs)
        docs.append(n)


def packing(H, HV, K=128, V=128, row_len=4096, micro_batch=2, doc_mean=1000, seed=0, op="packing",
            dtype="bfloat16", **kw) -> Scenario:
    return Scenario(op=op, layout="packing", H=H, HV=HV, K=K, V=V, T=row_len, micro_batch=micro_batch,
                    doc_mean=doc_mean, seed=seed, dtype=dtype,
                    lengths=packing_lengths(row_len, micro_batch, doc_mean, seed), **kw)


def _dense(B, T, H, HV, op="gdr", **kw):
    return Scenario(op=op, layout="dense", B=B, T=T, H=H, HV=HV, **kw)


FLA_SRC = "FLA/FlashQLA/FlashInfer comparison shape"
QWEN3NEXT_SRC = "Qwen3-Next-80B-A3B GDN (transformers Qwen3NextConfig defaults)"
QWEN35_SRC = "Qwen3.5-35B-A3B GDN (transformers Qwen3_5MoeTextConfig defaults)"
QWEN35_BIG_SRC = "Qwen3.5-397B-A17B GDN (cache shapes in harmonyhu.com/2026/02/21/qwen3.5)"
CPU_SRC = "CPU-sized: same head shape, fewer tokens"

_ALL = [
    # FLA / FlashQLA / FlashInfer comparison shapes
    _dense(1, 32768, 16, 32, source=FLA_SRC),
    _dense(1, 32768, 16, 64, source=FLA_SRC),
    _dense(1, 65536, 2, 8, source=FLA_SRC),
    Scenario(op="gdr", layout="varlen", H=16, HV=64, lengths=(1024,) * 8, source=FLA_SRC),
    Scenario(op="gdr", layout="varlen", H=16, HV=32, lengths=(1024,) * 32,
             source="32 sequences of 1024 tokens packed, the anchor shape's heads"),
    # model shapes
    _dense(1, 8192, 16, 32, prefix="QWEN3NEXT_", source=QWEN3NEXT_SRC),
    _dense(1, 8192, 16, 32, prefix="QWEN35_", source=QWEN35_SRC),
    _dense(1, 8192, 16, 64, prefix="QWEN35BIG_", source=QWEN35_BIG_SRC),
    # the packing scenario this project exists for (gdr op; layer/hybrid below)
    packing(16, 32, prefix="QWEN3NEXT_", source=QWEN3NEXT_SRC + "; 2 x 4096 rows, ~1000-token docs"),
    packing(16, 64, prefix="QWEN35BIG_", source=QWEN35_BIG_SRC + "; 2 x 4096 rows, ~1000-token docs"),
    # conv over q|k|v channels (2*H*K + HV*V), the decode step, layers
    Scenario(op="conv", layout="dense", B=1, T=32768, H=16, HV=32, hidden=8192,
             source="long-sequence conv: T=32768, D=8192 (q|k|v of 16/32 heads)"),
    packing(16, 32, op="conv", hidden=8192, prefix="QWEN3NEXT_", source=QWEN3NEXT_SRC + " (q|k|v = 8192 ch)"),
    Scenario(op="recurrent", layout="decode", B=256, H=16, HV=32, dtype="bfloat16",
             prefix="QWEN3NEXT_", source=QWEN3NEXT_SRC + "; one decode step of 256 sequences"),
    packing(16, 32, op="layer", hidden=2048, prefix="QWEN3NEXT_", source=QWEN3NEXT_SRC),
    packing(2, 4, K=64, V=64, op="hybrid", hidden=256, prefix="SMALL_",
            source="small HybridLM 'GGGA' (2/4 heads, dim 64, width 256)"),
    # CPU-sized scenarios of the default suite
    _dense(1, 512, 16, 32, dtype="float32", label="CPU_B1_T512_H16x32_K128_V128", source=CPU_SRC),
    packing(2, 4, dtype="float32", label="CPU_PACK_L4096_MB2_DOC1000_H2x4_K128_V128",
            source=CPU_SRC + " (heads cut 8x, lengths kept: the padding ratio is the real one)"),
    packing(2, 4, dtype="float32", op="conv", hidden=1024, label="CPU_CONV_PACK_L4096_MB2_DOC1000_D1024",
            source=CPU_SRC + " (q|k|v channels of 2/4 heads, dim 128)"),
    packing(2, 4, dtype="float32", op="layer", hidden=512, label="CPU_LAYER_PACK_L4096_MB2_DOC1000_H2x4_D512",
            source=CPU_SRC),
    packing(2, 4, K=64, V=64, dtype="float32", op="hybrid", hidden=256,
            label="CPU_HYBRID_PACK_L4096_MB2_DOC1000_H2x4_K64_D256", source=CPU_SRC),
    # tiny: tests and smoke runs
    Scenario(op="gdr", layout="varlen", H=2, HV=4, K=32, V=32, dtype="float32", lengths=(37, 64, 100),
             label="TINY_N3_T201_H2x4_K32_V32", source="tests"),
    packing(1, 2, K=32, V=32, row_len=128, micro_batch=1, doc_mean=40, dtype="float32",
            label="TINY_PACK_L128_MB1_DOC40_H1x2_K32_V32", source="tests"),
]

SCENARIOS = {s.name: s for s in _ALL}
assert len(SCENARIOS) == len(_ALL), "duplicate scenario names"

# op -> modes it runs
OP_MODES = {"gdr": ("fwd", "bwd", "fwdbwd"), "packing": ("fwd", "fwdbwd"), "conv": ("fwd", "fwdbwd"),
            "recurrent": ("fwd",), "layer": ("fwd", "fwdbwd"), "hybrid": ("fwdbwd",)}


@dataclass(frozen=True)
class Job:
    """One sweep entry: a scenario, the modes and the providers to run on it (None = all)."""
    scenario: str
    modes: Tuple[str, ...]
    providers: Optional[Tuple[str, ...]] = None
    op: Optional[str] = None     # run the scenario under this op instead of its own (e.g. gdr shape as packing)


SUITES = {
    "default": (
        Job("CPU_PACK_L4096_MB2_DOC1000_H2x4_K128_V128", ("fwd",), ("ours-torch", "hf-torch")),
        Job("CPU_B1_T512_H16x32_K128_V128", ("fwd",), ("ours-torch", "hf-torch", "naive")),
        Job("CPU_B1_T512_H16x32_K128_V128", ("fwdbwd",), ("ours-torch", "hf-torch")),
    ),
    "cpu-extra": (
        Job("CPU_CONV_PACK_L4096_MB2_DOC1000_D1024", ("fwd", "fwdbwd"), ("ours-torch",)),
        Job("CPU_LAYER_PACK_L4096_MB2_DOC1000_H2x4_D512", ("fwd", "fwdbwd"), ("ours",)),
        Job("CPU_HYBRID_PACK_L4096_MB2_DOC1000_H2x4_K64_D256", ("fwdbwd",), ("ours",)),
    ),
    "gpu": (
        Job("B1_T32768_H16x32_K128_V128", ("fwd", "fwdbwd")),
        Job("B1_T32768_H16x64_K128_V128", ("fwd", "fwdbwd")),
        Job("B1_T65536_H2x8_K128_V128", ("fwd", "fwdbwd")),
        Job("N8_L1024_H16x64_K128_V128", ("fwd", "fwdbwd")),
        Job("QWEN3NEXT_PACK_L4096_MB2_DOC1000_H16x32_K128_V128", ("fwd", "fwdbwd")),
        Job("B1_T32768_H16x32_K128_V128_D8192", ("fwd", "fwdbwd")),
        Job("QWEN3NEXT_DECODE_N256_H16x32_K128_V128", ("fwd",)),
        Job("QWEN3NEXT_PACK_L4096_MB2_DOC1000_H16x32_K128_V128_D2048", ("fwd", "fwdbwd")),
        Job("SMALL_PACK_L4096_MB2_DOC1000_H2x4_K64_V64_D256", ("fwdbwd",)),
    ),
    "tiny": (
        Job("TINY_N3_T201_H2x4_K32_V32", ("fwd", "fwdbwd")),
        Job("TINY_PACK_L128_MB1_DOC40_H1x2_K32_V32", ("fwd",)),
    ),
}

SUITE_DOCS = {
    "default": "the README's main job on a CPU: gdr packed vs padded, ours vs peers (about a minute)",
    "cpu-extra": "conv, GDN layer and hybrid LM, packed vs padded, on a CPU (a few minutes)",
    "gpu": "an H200: FLA comparison shapes, the packing scenario, conv, decode, layer, hybrid (< 10 min)",
    "tiny": "seconds: the tests' smoke run",
}
assert set(SUITE_DOCS) == set(SUITES), "every suite needs a line in SUITE_DOCS"

assert all(j.scenario in SCENARIOS for jobs in SUITES.values() for j in jobs), "suite names a missing scenario"
