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
