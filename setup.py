"""The one thing pyproject.toml cannot say: the wheel also installs `artrl-art.pth` into site-packages.

That file runs `_artrl_art.install()` at interpreter start, so `import art` resolves to artrl where openpipe-art
is not installed (src/_artrl_art.py says when it applies). A wheel takes it from build_lib's root; an editable
install (`pip install -e .`) from the unpacked wheel's root, which setuptools' editable build installs as is.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "artrl-art.pth"
PTH_LINE = "import _artrl_art; _artrl_art.install()\n"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        roots = [self.build_lib]
        if getattr(self, "editable_mode", False):
            roots.append(self.get_finalized_command("install").install_lib)
        for root in roots:
            os.makedirs(root, exist_ok=True)
            with open(os.path.join(root, PTH), "w") as f:
                f.write(PTH_LINE)

    def get_outputs(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return [*super().get_outputs(*args, **kwargs), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
