"""The sm_90 (H200) kernel inspector behind `python -m bench kernels`: every Triton kernel the launchers
run (ours and FLA's), compiled for the H200 without a GPU, read, and timed by a model.

    hopper.py     the H200's constants (SM count, clocks, bandwidth, register file, ...), in one place,
                  and fake_hopper(): triton's driver and torch.cuda answering as one H200
    launches.py   what the launchers launch: the Recorder, our op bodies and FLA's autograd on meta tensors
    toolchain.py  triton.compile for sm_90 and cuobjdump: registers, spills, shared memory, TTIR, SASS
    ttir.py       per-program FLOPs, tile bytes, loop trip counts and dots, read from the TTIR
    sass.py       the SASS: instructions, the sequential chunk loop's per-iteration counts, and one warp's
                  critical path through the kernel (simulate)
    model.py      the timing model and its constants (bench/NOTES.md, "sm_90 report")
    validate.py   the model against FLA's published H200 times (published_h200.csv): fit and check
    cuda_chunk.py the sm_90a CUDA chunked forward (csrc/, nvcc): its roles simulated one by one
    cuda_table.py the chunk table with gdn_packed._C built: csrc/chunk_table.cu's two launches (nvcc)
    report.py     rows per launch, totals, the text table and the result files
    command.py    the `python -m bench kernels` command line
"""
