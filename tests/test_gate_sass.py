"""SASS parser and classifier (int8attn.gate.sass) on stored real cuobjdump output."""

import json
from collections import Counter
from pathlib import Path

import pytest

from int8attn.gate import sass

DATA = Path(__file__).parent / "data" / "sass"
EXPECTED = {k: v for k, v in json.loads((DATA / "expected.json").read_text()).items() if not k.startswith("_")}


def test_every_stored_sample_has_expectations_and_vice_versa():
    files = {p.name for p in DATA.glob("*.txt")}
    assert files, "no stored SASS samples"
    assert files == set(EXPECTED), f"unlisted: {files - set(EXPECTED)}, missing: {set(EXPECTED) - files}"


@pytest.mark.parametrize("name", [pytest.param(n, id=n.removesuffix(".txt")) for n in sorted(EXPECTED)])
def test_stored_sample_classifies_as_expected(name):
    want = EXPECTED[name]
    text = (DATA / name).read_text()
    functions = sass.parse_sass(text)
    assert want["function"] in functions
    summary = sass.summarize(text, want["function"])
    for cls in want["classes"]:
        assert sass.has_class(summary, cls), f"{name}: {cls} not found in {summary['classes']}"
    for cls in want.get("absent", []):
        assert not sass.has_class(summary, cls), f"{name}: {cls} unexpectedly found"
    ops = set(summary["mma"]) | set(summary["convert"])
    for prefix in want.get("opcodes", []):
        assert any(op.startswith(prefix) for op in ops), f"{name}: no {prefix}* in {sorted(ops)}"


def test_parser_reads_predicates_modifiers_and_skips_encoding_lines():
    text = """
	code for sm_90a
		Function : my_kernel
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;               /* 0x00000a00ff017b82 */
                                                                        /* 0x000fe20000000800 */
        /*0010*/              @!P0 IGMMA.64x128x32.S8.S8 R24, gdesc[UR4], RZ, !UPT ;  /* 0x03600000041879f1 */
        /*0020*/               @P1 HGMMA.64x64x16.F32.BF16 R0, gdesc[UR8], R0 ;      /* 0x0 */
        /*0030*/                   I2F.S8 R3, R4 ;                      /* 0x0 */
        /*0040*/                   EXIT ;                               /* 0x0 */
		Function : other
        /*0000*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R0, gdesc[UR4], RZ ;  /* 0x0 */
"""
    functions = sass.parse_sass(text)
    assert set(functions) == {"my_kernel", "other"}
    assert functions["my_kernel"] == Counter({"LDC": 1, "IGMMA.64x128x32.S8.S8": 1, "HGMMA.64x64x16.F32.BF16": 1,
                                              "I2F.S8": 1, "EXIT": 1})
    mine = sass.summarize(text, "my_kernel")
    assert mine["classes"] == {"INT8": 1, "BF16": 1}
    assert mine["convert"] == {"I2F.S8": 1}
    assert sass.summarize(text)["classes"] == {"INT8": 1, "BF16": 1, "FP8": 1}
    with pytest.raises(KeyError):
        sass.summarize(text, "missing")


@pytest.mark.parametrize("opcode,cls", [
    pytest.param(op, cls, id=op)
    for op, cls in [
        ("IGMMA.64x128x32.S8.S8", "INT8"), ("IMMA.16832.S8.S8.SAT", "INT8"), ("IMMA.8832.S4.S4", "INT4"),
        ("QGMMA.64x64x32.F32.E4M3.E4M3", "FP8"), ("HGMMA.64x64x16.F32.BF16", "BF16"),
        ("HGMMA.64x64x16.F32", "FP16"), ("HMMA.16816.F32.BF16", "BF16"), ("HMMA.1684.F32.TF32", "TF32"),
        ("DMMA.884", "FP64"), ("FFMA", None), ("LDSM.16.M88.4", None),
    ]
])
def test_mma_class(opcode, cls):
    assert sass.mma_class(opcode) == cls


@pytest.mark.parametrize("name,cls", [
    pytest.param("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "BF16",
                 id="sm90-gemm-bf16"),
    pytest.param("sm90_xmma_gemm_s8s8_s32_tn_n_tilesize128x128x128", "INT8", id="sm90-gemm-s8s8"),
    pytest.param("sm80_xmma_gemm_i8i8_i32i32_i32_tn_n", "INT8", id="sm80-gemm-i8i8"),
    pytest.param("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n", "FP8", id="sm90-gemm-e4m3"),
    pytest.param("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", None, id="nvjet-unnamed-type"),
])
def test_library_kernel_class_from_name(name, cls):
    assert sass.infer_class_from_name(name) == cls


LOOPS_SASS = """
        Function : _outer_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, RZ ;
        /*0020*/                   IGMMA.64x64x32.S8.S8 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   FMUL R3, R3, R4 ;
        /*0040*/              @P0 BRA 0x20 ;
        /*0050*/                   LDG.E R5, desc[UR6][R2.64] ;
        /*0060*/              @!P1 BRA 0x50 ;
        /*0070*/                   BRA 0x80 ;
        /*0080*/                   EXIT ;
        Function : _second_kernel
        /*0000*/                   FADD R1, R2, R3 ;
        /*0010*/                   BRA 0x0 ;
"""


def test_loops_are_backward_branches_in_program_order():
    bodies = sass.loops(LOOPS_SASS)
    assert bodies == [["IGMMA.64x64x32.S8.S8", "FMUL", "BRA"], ["LDG.E", "BRA"], ["FADD", "BRA"]]
    assert sass.loops(LOOPS_SASS, "_second_kernel") == [["FADD", "BRA"]]
    ins = sass.instructions(LOOPS_SASS)["_outer_kernel"]
    assert ins[4] == (0x40, "BRA", " 0x20 ")  # the predicate is not part of the opcode


def test_excerpt_keeps_every_matrix_instruction_and_stays_parseable():
    text = (DATA / "aot39_sm90_qk_int8_to_bf16.txt").read_text()
    small = sass.excerpt(text, max_lines=40)
    assert len(small.splitlines()) <= 40
    assert sass.summarize(small)["classes"].get("BF16", 0) > 0


def test_dump_sass_reports_a_missing_tool(tmp_path):
    with pytest.raises((FileNotFoundError, RuntimeError)):
        sass.dump_sass(b"not a cubin", cuobjdump=str(tmp_path / "no-such-cuobjdump"))


def _aot_toolchain_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("triton.backends.nvidia.compiler") is None:
        return False
    return sass.find_cuobjdump() is not None


@pytest.mark.skipif(not _aot_toolchain_available(), reason="needs Triton's NVIDIA backend and cuobjdump")
def test_compile_and_disassemble_an_int8_probe_end_to_end():
    """The SASS pipeline without a GPU: compile a tl.dot probe for sm_90, dump, classify."""
    from int8attn.gate import probe

    text = probe.probe_sass("int8", num_warps=4, target=(90, 32))
    summary = sass.summarize(text, "_probe_dot")
    assert summary["classes"].get("INT8", 0) > 0
    assert any(op.startswith("IGMMA") for op in summary["mma"])
