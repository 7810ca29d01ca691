"""The worker-exit PTX rewrite, :mod:`int8attn.kernels._worker_exit` (CPU, no compile).

The rewrite must change only marked PTX, replace exactly the worker partitions' jumps back
to Triton's dispatch loop by the next dispatch barrier and a jump to the exit state's label,
and refuse dispatch shapes it does not know (rather than emit a kernel that might hang). The
sm_90 effect on the real kernel (ptxas keeps the consumers' PV in flight) is checked by
``tests/test_prefill_hopper.py::test_compiles_for_sm90_with_warpgroup_mmas[ws-int8-pv16-d128-pv-ahead]``.
"""

import pytest

from int8attn.kernels import _worker_exit as we

#: The shape of Triton 3.6's lowering of one warp_specialize region with two workers (trimmed).
DISPATCH = """\
.entry k(
)
{
\t// begin inline asm
\t// int8attn:worker-exit
\tmov.b32 %r1, %r2;
\t// end inline asm
\tst.shared.v2.b32 \t[global_smem+149872], {0, 16843009};
\tbarrier.sync \t1;
\tbra.uni \t$L__BB0_2;
$L__BB0_32:                             // %._crit_edge679
\tbarrier.sync \t1;
\tsetmaxnreg.inc.sync.aligned.u32 \t120;
$L__BB0_2:                              // %.preheader
\tsetmaxnreg.dec.sync.aligned.u32 \t120;
\tbarrier.sync \t1;
\tld.shared.b8 \t%rs5, [%r171+149868];
\tsetp.eq.b16 \t%p3, %rs5, 0;
\t@%p3 bra \t$L__BB0_6;
\tsetp.eq.b16 \t%p4, %rs5, 1;
\t@%p4 bra \t$L__BB0_20;
\tsetp.eq.b16 \t%p5, %rs5, 2;
\t@%p5 bra \t$L__BB0_47;
\tbarrier.sync \t1;
\tbra.uni \t$L__BB0_2;
$L__BB0_20:
\tsetmaxnreg.dec.sync.aligned.u32 \t40;
\tbra.uni \t$L__BB0_32;
$L__BB0_6:
\tsetmaxnreg.inc.sync.aligned.u32 \t232;
\twgmma.wait_group.sync.aligned 1;
\t.loc\t1 777 0
\tbarrier.sync \t1;
\tsetmaxnreg.dec.sync.aligned.u32 \t120;
\tbra.uni \t$L__BB0_2;
$L__BB0_46:
\tst.shared.v2.b32 \t[global_smem+149872], {33686018, 33686018};
\tbarrier.sync \t1;
$L__BB0_47:                             // %common.ret
\tret;
}
"""


def test_unmarked_ptx_passes_through_unchanged():
    plain = DISPATCH.replace(we.MARK, "something else")
    assert we.rewrite(plain) is plain


def test_the_worker_back_edge_becomes_the_dispatch_barrier_and_the_exit():
    out = we.rewrite(DISPATCH)
    lines = [line.strip() for line in out.splitlines()]
    end = lines.index("setmaxnreg.dec.sync.aligned.u32 \t120;", lines.index("wgmma.wait_group.sync.aligned 1;"))
    assert lines[end + 1:end + 3] == ["barrier.sync \t1;", "bra.uni \t$L__BB0_47;"]
    # the dispatch loop's own "no state" edge and the loader's fall-through stay
    assert out.count("bra.uni \t$L__BB0_2;") == DISPATCH.count("bra.uni \t$L__BB0_2;") - 1
    assert len(lines) == len(DISPATCH.splitlines()) + 1


def test_a_jump_table_dispatch_is_read_in_state_order():
    table = DISPATCH.replace(
        "\tsetp.eq.b16 \t%p3, %rs5, 0;\n\t@%p3 bra \t$L__BB0_6;\n\tsetp.eq.b16 \t%p4, %rs5, 1;\n"
        "\t@%p4 bra \t$L__BB0_20;\n\tsetp.eq.b16 \t%p5, %rs5, 2;\n\t@%p5 bra \t$L__BB0_47;\n",
        "\tsetp.gt.u32 \t%p3, %rs5, 2;\n\t@%p3 bra \t$L__BB0_4;\n\t$L_brx_0: .branchtargets\n"
        "\t\t$L__BB0_6,\n\t\t$L__BB0_20,\n\t\t$L__BB0_47;\n\tbrx.idx \t%rs5, $L_brx_0;\n")
    assert "brx.idx" in table
    assert "bra.uni \t$L__BB0_47;" in we.rewrite(table)


@pytest.mark.parametrize("broken,match", [
    (lambda p: p.replace("ld.shared.b8", "ld.shared.b16"), "one worker-state load"),
    (lambda p: p.replace("setp.eq.b16 \t%p4, %rs5, 1;", "setp.eq.b16 \t%p4, %rs5, 7;"), "unexpected worker dispatch"),
    (lambda p: p.replace("{33686018, 33686018}", "{0, 16843009}", 1) + "\n" * 10
     + "\tst.shared.v2.b32 \t[global_smem+149872], {0, 16843009};\n", "one warp_specialize region"),
    (lambda p: p.replace("\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n\tbra.uni", "\tbra.uni"), "no worker partition"),
], ids=["no-state-load", "states-out-of-order", "two-regions", "no-back-edge"])
def test_unknown_dispatch_shapes_are_refused(broken, match):
    with pytest.raises(ValueError, match=match):
        we.rewrite(broken(DISPATCH))


def test_install_chains_an_existing_hook_once_and_keys_the_cache():
    knobs = pytest.importorskip("triton").knobs
    saved = knobs.runtime.add_stages_inspection_hook
    seen = []

    def other(*args):
        if not args:
            return "other", "h"
        seen.append(args)

    try:
        knobs.runtime.add_stages_inspection_hook = other
        assert we.install()
        assert we.install()  # idempotent: one wrapper
        hook = knobs.runtime.add_stages_inspection_hook
        assert hook is not other and hook() == ("other" + we._KEY, "h" + we._KEY)
        stages = {"ptx": lambda src, metadata: DISPATCH, "cubin": lambda src, metadata: b""}
        hook(None, stages, None, None, 90)
        assert len(seen) == 1 and "bra.uni \t$L__BB0_47;" in stages["ptx"]("", {})
    finally:
        knobs.runtime.add_stages_inspection_hook = saved
