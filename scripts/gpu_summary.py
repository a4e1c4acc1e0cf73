"""Condense a GPU check's outputs ($OUT) into one JSON summary: device, versions, commit, tests."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(out: str) -> None:
    out_dir = Path(out)
    device_txt = Path(os.environ.get("KDA_DEVICE_TXT", out_dir / "device.txt"))
    summary = {"device": device_txt.read_text().strip().splitlines()[-1:]
               if device_txt.exists() else None}
    try:
        import torch
        summary["torch"] = torch.__version__
        summary["cuda"] = torch.version.cuda
    except ImportError:
        pass
    summary["commit"] = os.environ.get("KDA_COMMIT")
    if not summary["commit"]:
        try:
            summary["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip() or None
        except OSError:
            summary["commit"] = None
    xml = out_dir / "gpu_tests.xml"
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                                "skipped")}
        summary["failed"] = [f"{c.get('classname')}::{c.get('name')}"
                             for c in suite.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    bench = out_dir / "bench.json"
    if bench.exists():
        summary["bench"] = json.loads(bench.read_text()).get("summary")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
