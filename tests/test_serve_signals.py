"""A signal while serve starts, warms up or drains stops it at the next step between them, never
where the main thread happens to be: raised mid-step (half through starting a thread, inside a
lock) it left serve hung after SIGTERM or crashing at exit, about one signal in ten. While the
runtime loads it still stops at once (Signals.immediately; test_serve_lifecycle's gated load)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from edgekv.serve.signals import Signals, Stop


def test_a_signal_while_starting_waits_for_a_check():
    with Signals() as s:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on the main thread: no Stop yet
        time.sleep(0.01)
        with pytest.raises(Stop) as e:
            s.check()
    assert e.value.signum == signal.SIGTERM and s.first is None


def test_immediately_a_signal_raises_where_it_lands():
    with Signals() as s:
        with pytest.raises(Stop):
            with s.immediately():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs during the sleep and raises
                pytest.fail("no Stop")


def test_a_stop_swallowed_while_loading_is_raised_after():
    """pybind11 turns an exception raised inside onnxruntime's module init into an ImportError and the
    backend falls back to the next provider: the load ends normally, the signal must still stop."""
    with Signals() as s:
        with pytest.raises(Stop) as e:
            with s.immediately():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1)
                except Stop:
                    pass  # what a fallback that catches the converted error does
        assert e.value.signum == signal.SIGTERM
        s.serving()
        with pytest.raises(Stop):
            s.wait_first()  # and serving would not wait for a second signal either


def test_an_error_a_swallowed_stop_left_behind_is_the_stop():
    """The fallback's own import then fails ("onnxruntime is not installed"): a signal, not an error."""
    with Signals() as s:
        with pytest.raises(Stop):
            with s.immediately():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1)
                except Stop:
                    raise ImportError("initialization failed") from None


def test_a_signal_before_serving_began_stops_wait_first():
    with Signals() as s:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        s.serving()
        with pytest.raises(Stop):
            s.wait_first()


def test_serving_then_draining():
    with Signals() as s:
        s.serving()
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.wait_first() == signal.SIGTERM  # the first: drain
        s.check()  # nothing more came
        os.kill(os.getpid(), signal.SIGINT)  # the second, while draining: stop at once
        time.sleep(0.01)
        with pytest.raises(Stop):
            s.check()


def test_sigterm_at_any_moment_of_startup_ends_serve(tiny_bundle_int8):
    """SIGTERM at moments spread over the start (load, layout, warm-up, ready): serve always exits,
    soon, with 0 (or the default action's 143 before its handler is installed)."""
    cmd = [sys.executable, "-m", "edgekv", "serve", str(tiny_bundle_int8), "--port", "0", "--ctx", "64",
           "--threads", "1", "--quiet"]
    for delay in [0.2 + 0.1 * i for i in range(14)]:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"serve hung after SIGTERM {delay:.1f} s into its start")
        assert p.returncode in (0, -signal.SIGTERM), (delay, p.returncode, err[-800:])
        assert "Traceback" not in err, (delay, err[-800:])


def test_a_signal_during_a_native_import_waits_until_it_is_in(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM under serve) inside onnxruntime's module init left it half made (an
    ImportError, a nanobind abort, a segfault in the next import): import_native holds it, then
    raises it where its own handler can run."""
    from edgekv.runtime import backends

    (tmp_path / "slow_native_mod.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.05)\ndone = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backends.NATIVE_MODULES, "test-backend", ("slow_native_mod",))
    monkeypatch.delitem(sys.modules, "slow_native_mod", raising=False)
    # Python's own Ctrl-C handler (an xdist worker ignores SIGINT: nothing would be raised after)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            backends.import_native("test-backend")
        assert sys.modules["slow_native_mod"].done  # the import finished before the interrupt
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler back
    finally:
        signal.signal(signal.SIGINT, before)
