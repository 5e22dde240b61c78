"""The package's build backend: setuptools' own, with its scratch directories outside the source tree.

``pip wheel .`` and ``pip install .`` build in the source tree, and setuptools writes its ``build/`` directory
and ``dlx_node.egg-info`` there: a clone kept them after a wheel build (and the egg-info of an editable
install was rewritten). Here every build gets a temporary directory for both (setuptools reads the extra
configuration file that ``DIST_EXTRA_CONFIG`` names), removed when the build ends. Everything else is
setuptools.build_meta's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks this module does not wrap)


@contextlib.contextmanager
def _scratch_outside_the_tree():
    with tempfile.TemporaryDirectory(prefix="dlx-build-") as scratch:
        config = os.path.join(scratch, "setup.cfg")
        with open(config, "w", encoding="utf-8") as out:
            out.write(f"[build]\nbuild_base = {scratch}/build\n[egg_info]\negg_base = {scratch}\n")
        before = os.environ.get("DIST_EXTRA_CONFIG")
        os.environ["DIST_EXTRA_CONFIG"] = config
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("DIST_EXTRA_CONFIG", None)
            else:
                os.environ["DIST_EXTRA_CONFIG"] = before


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with _scratch_outside_the_tree():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    with _scratch_outside_the_tree():
        return _setuptools.build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    with _scratch_outside_the_tree():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def get_requires_for_build_wheel(config_settings=None):
    with _scratch_outside_the_tree():
        return _setuptools.get_requires_for_build_wheel(config_settings)
