"""Install hpcddp-torchrun-env.pth into site-packages beside the package; the metadata is in setup.cfg.

A rank that a plain ``mpirun``/``srun`` started then gets torchrun's variables before its
script (``hpcddp/_site/_hpcddp_startup.py``). A wheel carries it at its root (``build_py``);
an editable install (``pip install -e .``, PEP 660) builds a wheel of its own that setuptools
fills with a path hook only, so the file is added to that wheel too, with its RECORD line
(as coverage.py ships its .pth). Its name sorts after setuptools' ``__editable__.*.pth``,
which must have run first: that one makes hpcddp importable in an editable install.
"""

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path("hpcddp", "_site", "hpcddp-torchrun-env.pth")


class BuildPyWithPth(build_py):
    """build_py that also puts the .pth at the root of build_lib, which becomes site-packages."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(str(PTH), os.path.join(self.build_lib, PTH.name), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH.name)]


class EditableWheelWithPth(editable_wheel):
    """editable_wheel that adds the .pth to the wheel it built."""

    def run(self):
        super().run()
        wheels = sorted(Path(self.dist_dir).glob("*.editable-*.whl"), key=os.path.getmtime)
        if not wheels:
            raise RuntimeError(f"no editable wheel in {self.dist_dir} to add {PTH.name} to")
        _add_to_wheel(wheels[-1], PTH.name, PTH.read_bytes())


def _add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` at its root and listed in its RECORD (hash and size)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{name},sha256={digest},{len(data)}\n".encode()
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as target:
        records = [item for item in source.infolist() if item.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{wheel} has {len(records)} RECORD files, expected 1")
        target.writestr(name, data)
        for item in source.infolist():
            payload = source.read(item.filename)
            if item is records[0]:
                payload += record_line
            target.writestr(item, payload)
    os.replace(rewritten, wheel)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
