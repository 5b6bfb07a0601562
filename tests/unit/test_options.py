"""The recording options the plugin reads from MOETRACE_RECORD: what each form means, and one-line refusals."""

from __future__ import annotations

import json
import logging

import pytest

from moetrace.hooks.options import RecordingOptions
from moetrace.hooks.plugin import ENV_VAR, recording_options


def test_a_bare_directory_or_a_json_object_gives_the_options_with_defaults_elsewhere() -> None:
    assert RecordingOptions.from_text("/tmp/run") == RecordingOptions(out="/tmp/run")
    options = RecordingOptions.from_text('{"out": "/tmp/run", "steps": 200, "candidates": 16}')
    assert (options.out, options.steps, options.candidates) == ("/tmp/run", 200, 16)
    assert (options.seconds, options.token_ids, options.rotate_seconds) == (None, True, 10.0)


def test_the_json_written_is_read_back_to_the_same_options() -> None:
    options = RecordingOptions(out="/tmp/run", run_id="r/k3", candidates=8, time_phases_every=4, seconds=2.5,
                               workload={"count": 3, "sampling": {"temperature": 0.0}})
    assert RecordingOptions.from_text(options.to_text()) == options
    assert json.loads(options.to_text())["workload"] == {"count": 3, "sampling": {"temperature": 0.0}}


@pytest.mark.parametrize("raw, message", [
    ('{"out": "/tmp/run", "step": 5}', "unknown option(s) step (known: "),
    ('{"steps": 5}', "'out' must name the trace directory"),
    ('{"out": "/tmp/run", "steps": "5"}', "'steps' must be a non-negative integer, got '5'"),
    ('{"out": "/tmp/run", "seconds": 0}', "'seconds' must be a positive number, got 0"),
    ('{"out": "/tmp/run", "candidates": true}', "'candidates' must be a non-negative integer, got True"),
    ('{"out": "/tmp/run", "metrics_port": 70000}', "'metrics_port' must be a port number (1-65535), got 70000"),
    ('{"out": "o", "partition_seconds": 0.5}', "'partition_seconds' must be at least 1, got 0.5"),
    ('{"out": "o", "partition_seconds": 60, "steps": 10}', "'partition_seconds' records until shutdown"),
    ('{"out": "o", "disk_cap_bytes": 100}', "'disk_cap_bytes' must be a positive integer beside 'partition_seconds'"),
    ('{"out": "o", "partition_seconds": 60, "at_cap": "wait"}', "'at_cap' must be one of drop-oldest, stop"),
    ('{"out": "o", "sample_steps": 8}', "a sampled recording takes both"),
    ('{"out": "o", "sample_steps": 0, "sample_every_seconds": 60}', "a sampled recording takes both 'sample_steps'"),
    ('{"out": "o", "sample_steps": 8, "sample_every_seconds": 0}', "'sample_every_seconds' must be a positive"),
    ('{"out": "o", "sample_steps": 8, "sample_every_seconds": 60, "seconds": 5}', "a sampled recording runs until"),
    ('{"out": "o", "sample_requests": 1}', "'sample_requests' must be an integer of at least 2 (one request in N)"),
    ('{"out": "o", "sample_requests": 4, "sample_steps": 8, "sample_every_seconds": 60}', "one sampling policy at a"),
])
def test_a_wrong_option_is_named(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        RecordingOptions.from_text(raw)


def test_the_plugin_does_not_record_with_malformed_options_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV_VAR, '{"out": "/tmp/run", "sample_seconds": 5}')
    with caplog.at_level(logging.WARNING):
        assert recording_options() is None
    assert "moetrace: not recording: MOETRACE_RECORD is not valid (unknown option(s) sample_seconds" in caplog.text
    monkeypatch.setenv(ENV_VAR, '{"out": ')
    assert recording_options() is None
    monkeypatch.delenv(ENV_VAR)
    assert recording_options() is None
