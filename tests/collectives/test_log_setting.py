"""QCOLL_LOG, read in one place (qcoll._log): the topics it names, spaces allowed, and an
unknown topic warned about once rather than ignored in silence."""

import warnings

import pytest

from qcoll import _log


@pytest.mark.parametrize("setting, on", [
    ("policy", {"policy"}),
    ("transport,policy", {"policy", "transport"}),
    (" policy , transport ", {"policy", "transport"}),
    ("", set()),
    ("transports", set()),  # a near miss is not the topic
])
def test_enabled_reads_the_named_topics(monkeypatch, setting, on):
    monkeypatch.setenv("QCOLL_LOG", setting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert {t for t in _log.TOPICS if _log.enabled(t)} == on


def test_an_unknown_topic_warns_once_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv("QCOLL_LOG", "policy,polcy")
    monkeypatch.setattr(_log, "_warned", set())
    with pytest.warns(UserWarning, match="unknown topic.*polcy.*known: policy, transport"):
        assert _log.enabled("policy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert not _log.enabled("transport")


@pytest.mark.parametrize("broken", ["closed", "pipe"])
def test_a_line_to_a_broken_stderr_is_lost_not_raised(monkeypatch, broken):
    import io

    class Pipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError("reader gone")

    stream = io.StringIO() if broken == "closed" else Pipe()
    if broken == "closed":
        stream.close()
    monkeypatch.setattr("sys.stderr", stream)
    _log.emit("qcoll: a line")  # no exception
