"""scripts/uv_options.py: pip's effective configuration becomes the uv options CI installs with."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("uv_options", REPO / "scripts" / "uv_options.py")
uv_options = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_options)

PIP_CONFIG_LIST = """\
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/global-wheels'
install.find-links='/opt/install-wheels'
:env:.find-links='/opt/env-wheels'
:env:.default-timeout='180'
"""


def test_environment_overrides_install_section_overrides_global(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, PIP_CONFIG_LIST, ""))
    config = uv_options.pip_config("python")
    assert config["find-links"] == "/opt/env-wheels"
    assert config["extra-index-url"] == "file:///opt/a/simple file:///opt/b/simple"
    assert config["default-timeout"] == "180"


def test_each_setting_becomes_its_uv_option():
    config = {"extra-index-url": "file:///opt/a/simple file:///opt/b/simple", "find-links": "/w",
              "constraint": "/c.txt", "cert": "/ca.crt", "default-timeout": "180"}
    assert uv_options.uv_options(config) == [
        "--index-strategy", "unsafe-best-match",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--find-links", "/w", "--constraint", "/c.txt", "--native-tls"]


def test_no_configuration_keeps_only_pips_index_rule():
    assert uv_options.uv_options({}) == ["--index-strategy", "unsafe-best-match"]
