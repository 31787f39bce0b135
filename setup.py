"""Build step that pyproject.toml cannot express: ship `lcx-lmeval-hook.pth` in site-packages.

Everything else about the package is declared in pyproject.toml. The `.pth` file's one line
runs `lcx._lmeval_hook.install()` at interpreter start-up, which registers the `lcx` lm-eval
model and lcx's lm-eval tasks lazily (see that module). A `.pth` file must sit at the root of
site-packages, i.e. at the root of the wheel:

- regular wheels (`pip install .`, `pip wheel .`): `build_py` writes it into `build_lib`, whose
  whole tree becomes the wheel's root;
- editable installs (`pip install -e .`, PEP 660): setuptools builds the editable wheel from an
  import hook instead of `build_lib`, so `editable_wheel` adds the file to the wheel it just
  wrote (and to its RECORD).

tests/eval_tasks/test_lmeval_cli.py builds both kinds of wheel and checks the file is there.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "lcx-lmeval-hook.pth"
# Skipped entirely under LCX_NO_LMEVAL_HOOK=1; any failure is swallowed so that a broken lcx can
# never stop Python from starting (site.py would print a traceback for every interpreter).
PTH_LINE = (
    'import os; exec("try:\\n import lcx._lmeval_hook as _h\\nexcept Exception:\\n pass\\nelse:\\n'
    ' _h.install()") if os.environ.get("LCX_NO_LMEVAL_HOOK", "") not in ("1", "true", "yes") else None\n'
)


class build_py_with_pth(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib, PTH_NAME)
            target.write_text(PTH_LINE, encoding="utf-8")
            self._lcx_outputs = [str(target)]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *getattr(self, "_lcx_outputs", [])]


class editable_wheel_with_pth(editable_wheel):
    def run(self) -> None:
        dist_dir = Path(self.dist_dir)
        before = {p: p.stat().st_mtime_ns for p in dist_dir.glob("*.whl")} if dist_dir.is_dir() else {}
        super().run()
        built = [p for p in dist_dir.glob("*.whl") if before.get(p) != p.stat().st_mtime_ns]
        if len(built) != 1:
            raise RuntimeError(f"lcx setup.py: expected one new editable wheel in {dist_dir}, found {built}")
        add_file_to_wheel(built[0], PTH_NAME, PTH_LINE.encode("utf-8"))


def add_file_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite `wheel` with `name` added at its root and listed in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as zin:
        infos = [i for i in zin.infolist() if i.filename != name]
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        fd, tmp = tempfile.mkstemp(suffix=".whl", dir=wheel.parent)
        os.close(fd)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            zout.writestr(name, data)
            for info in infos:
                content = zin.read(info.filename)
                if info.filename == record:
                    lines = [ln for ln in content.decode().splitlines() if ln and not ln.startswith(f"{name},")]
                    lines.insert(0, f"{name},sha256={digest},{len(data)}")
                    content = ("\n".join(lines) + "\n").encode()
                zout.writestr(info, content)
    os.replace(tmp, wheel)


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
