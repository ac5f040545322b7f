"""The README's code blocks run as written; the demo runs end to end (tiny settings)."""

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_execute():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "readme"}
    for block in blocks:  # blocks build on each other, as a reader would run them
        exec(compile(block, "README.md", "exec"), namespace)
    idata = namespace["idata"]
    assert "client" in idata.log_likelihood["y"].coords
    assert idata.sample_stats["bits_up"].shape == (4, 1000)  # to_inference_data splits bits
    assert namespace["up"] > 0 and namespace["down"] > 0


def test_demo_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import demo
    finally:
        sys.path.pop(0)
    table = demo.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "demo.png").exists() and (tmp_path / "demo.md").exists()
    fed = table[table.method == "QLSD 4-bit"].iloc[0]
    lsd = table[table.method == "LSD (uncompressed)"].iloc[0]
    assert fed["uplink Mbit"] < lsd["uplink Mbit"]
