"""tools/uv_pip_args.py: uv must see the wheel locations pip is configured with (the torch CPU wheel
here), and nothing extra where pip has none."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "uv_pip_args.py"
_spec = importlib.util.spec_from_file_location("uv_pip_args", _PATH)
uv_pip_args = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_pip_args)

LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_pip_locations_become_uv_flags_once_each():
    assert uv_pip_args.uv_args(LISTING) == [
        "--find-links",
        "/opt/wheels",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/pypi-more/simple",
        "--index-strategy",
        "unsafe-best-match",
    ]


def test_index_url_and_no_configuration():
    assert uv_pip_args.uv_args("site.index-url='https://mirror/simple'\n")[:2] == [
        "--index-url",
        "https://mirror/simple",
    ]
    # No pip configuration (PyPI only): no location flags, pip's resolution strategy only.
    assert uv_pip_args.uv_args("global.cert='/x'\n") == ["--index-strategy", "unsafe-best-match"]
