"""`make mlflow`: where a config's runs are, and the MLflow UI opened on them."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

from dpadapter.tracking.lifecycle import end_dead_runs
from dpadapter.tracking.naming import runs_url
from dpadapter.tracking.store import TrackingError, ensure_experiment, probe, resolve_uri


def _serve(store: str, port: int, url: str) -> int:
    """`mlflow ui` over a local store, the browser opened on `url` once the UI answers."""
    import subprocess
    import time
    import urllib.request
    import webbrowser

    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port)]
    ui = subprocess.Popen([*cmd, "--backend-store-uri", store])
    try:
        deadline = time.monotonic() + 120
        while ui.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        if ui.poll() is None:
            print(f"open:  {url}", flush=True)
            webbrowser.open(url)  # False, and nothing shown, where there is no browser
        return ui.wait()
    except KeyboardInterrupt:
        ui.terminate()
        return ui.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m dpadapter.tracking CONFIG [--serve] [--port N]`: where a config's runs are.

    Prints the store and the URL of the config's experiment in the "DP runs" view. `--serve`
    (`make mlflow`) starts `mlflow ui` over a local store and opens that URL; with a tracking
    server the URL is the server's and nothing is started.
    """
    import argparse

    from dpadapter.settings import load

    ap = argparse.ArgumentParser(prog="python -m dpadapter.tracking")
    ap.add_argument("config")
    ap.add_argument("--serve", action="store_true", help="start the UI on a local store")
    ap.add_argument("--port", type=int, default=5000)
    args = ap.parse_args(argv)
    cfg = load(args.config)
    uri = resolve_uri(cfg.tracking, cfg.results_dir)
    store = uri.split("?", 1)[0]
    server = urlsplit(uri).scheme in ("http", "https")
    base = store if server else f"http://127.0.0.1:{args.port}"
    try:
        why = probe(uri)
        if why is not None:
            raise TrackingError(why)
        exp_id = ensure_experiment(cfg.tracking, cfg.results_dir)
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ended = end_dead_runs(exp_id)
    if ended:
        print(f"ended KILLED: {len(ended)} run(s) whose job process was gone")
    url = runs_url(base, exp_id)
    print(f"store: {store}")
    print(f"runs:  {url}", flush=True)
    if args.serve and not server:
        return _serve(store, args.port, url)
    return 0
