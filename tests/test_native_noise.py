"""The CUDA plugin's no-driver lines are dropped from a CPU host's stderr, nothing else is
(issue 46 item 8; the command-level check is in test_check_target.py)."""

import os

from actionopd_jax.commands.native_noise import drop_native_lines


def test_only_the_plugins_lines_are_dropped_and_the_rest_keeps_its_order(capfd):
    with drop_native_lines():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
                    b"I0000 00:00:1.2 1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
                    b"a real error from C++\n"
                    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
                    b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
                    b"and a second one\n")
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err
    assert err == "a real error from C++\nand a second one\nafter the block\n"


def test_what_was_written_is_kept_when_the_block_raises(capfd):
    try:
        with drop_native_lines():
            os.write(2, b"said before failing\n")
            raise ValueError("boom")
    except ValueError:
        pass
    assert capfd.readouterr().err == "said before failing\n"


def test_the_plugin_question_is_asked_without_importing_jax_and_follows_the_installed_major(tmp_path):
    """native_noise asks which CUDA plugin is installed before jax's first import, so the
    answer (actionopd_jax/cuda_plugin.py) must not import jax. A fake `jax_cuda13_plugin` put
    first on the path is the newest major found; without it, the real install's answer."""
    import subprocess
    import sys

    probe = ("import sys, actionopd_jax.cuda_plugin as c, actionopd_jax.commands.native_noise as n; "
             "print('jax' in sys.modules, c.cuda_plugin(), n._cuda_plugin_installed())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo
    real = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    jax_loaded, major, installed = real.stdout.split()
    assert jax_loaded == "False"
    assert installed == str(major != "None")
    (tmp_path / "jax_cuda13_plugin").mkdir()
    (tmp_path / "jax_cuda13_plugin" / "__init__.py").write_text("raise ImportError('never imported, only found')\n")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), repo])
    faked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert faked.stdout.split() == ["False", "13", "True"]
