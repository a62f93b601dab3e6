"""Copy a checkout's tracked files and patch the copy at named anchors: the shared part of the in-kernel trace tools
(moe_layer_trace.py, moe_down_trace.py). Each patch names the source text it attaches to; when the kernels change,
the tool stops with the anchor it missed instead of patching the wrong place."""
import subprocess
import sys
from pathlib import Path


def require(text, anchor, where, tool):
    """text, after checking that anchor occurs in it exactly once."""
    if text.count(anchor) != 1:
        sys.exit(f"{tool}: {where}: anchor found {text.count(anchor)} times (want 1):\n{anchor}")
    return text


def copy_and_patch(argv, patches, patch_test, doc, tool):
    """argv: [SRC, DST]. Copies SRC's tracked files to DST, applies patches {path: [(anchor, replacement)]}, then
    patch_test(text) to kernels/cuda/tests/moe_small_batch_test.cpp."""
    if len(argv) != 2:
        sys.exit(doc)
    src, dst = Path(argv[0]).resolve(), Path(argv[1])
    files = subprocess.run(["git", "ls-files"], cwd=src, check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = src / name
        if source.is_file():
            target.write_bytes(source.read_bytes())
    for name, file_patches in patches.items():
        path = dst / name
        text = path.read_text()
        for anchor, replacement in file_patches:
            text = require(text, anchor, name, tool).replace(anchor, replacement)
        path.write_text(text)
    test = dst / "kernels/cuda/tests/moe_small_batch_test.cpp"
    test.write_text(patch_test(test.read_text()))
    print(f"{tool}: patched tree in {dst}")


def patch_timing_test(text, declaration, body, tool):
    """moe_small_batch_test.cpp with `declaration` before its test namespace and `body` inside
    MoeDecodeLayerGpu.Timing, after its graph replays of each token count (T, c, d and stream in scope)."""
    anchor = "namespace deltaserve::kernels::cuda::test {\n"
    text = require(text, anchor, "moe_small_batch_test.cpp", tool).replace(anchor, declaration + anchor)
    anchor = '    d.p.down_split = 0;\n    d.expect_counter_zero("timing replays");\n'
    return require(text, anchor, "moe_small_batch_test.cpp", tool).replace(
        anchor, "    d.p.down_split = 0;\n" + body + '    d.expect_counter_zero("timing replays");\n')
