"""The one classification of failures (elastic_gpt.errors): which errors a retry cannot cure,
and the one line a user sees. Real exception objects of the libraries that raise them."""

from __future__ import annotations

import errno

import pytest

from elastic_gpt.data.stream import CorruptShardError
from elastic_gpt.errors import (
    ElasticRestart,
    FatalTrainingError,
    StorageFullError,
    exit_for_error,
    permanent_failure,
    user_error_line,
)


def raised(make):
    """An exception with its real chain: raise it the way library code does."""
    try:
        make()
    except BaseException as e:  # noqa: BLE001 - the point is to keep whatever was raised
        return e
    raise AssertionError("nothing raised")


def storage_wrapped(inner: BaseException):
    """Our readers turn a storage error into a ValueError line (`raise ... from None` keeps
    the original as __context__)."""
    def make():
        try:
            raise inner
        except BaseException:
            raise ValueError("cannot read s3://b/shard-00000.bin (...)") from None
    return raised(make)


def botocore_error(name: str, **kwargs):
    import botocore.exceptions as be
    return getattr(be, name)(**kwargs)


def client_error(code: str):
    from botocore.exceptions import ClientError
    return ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject")


@pytest.mark.parametrize("make, fragment", [
    (lambda: CorruptShardError("shard-00001.bin does not match its checksum"), "checksum"),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "storage is full"),
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), "storage is full"),
    (lambda: PermissionError(errno.EACCES, "Permission denied"), "refused access"),
    (lambda: botocore_error("NoCredentialsError"), "refused access"),
    (lambda: client_error("AccessDenied"), "refused access"),
    (lambda: client_error("InvalidAccessKeyId"), "refused access"),
    (lambda: storage_wrapped(botocore_error("NoCredentialsError")), "refused access"),
    (lambda: ValueError("train.lr=nan must be a finite number"), "finite number"),
])
def test_errors_no_retry_cures_stop_the_run(make, fragment):
    exc = make()
    fatal = permanent_failure(exc)
    assert isinstance(fatal, FatalTrainingError) and fragment in str(fatal)


@pytest.mark.parametrize("make", [
    lambda: ConnectionError("connection reset by peer"),
    lambda: TimeoutError("timed out"),
    lambda: OSError(errno.ECONNREFUSED, "Connection refused"),
    lambda: botocore_error("EndpointConnectionError", endpoint_url="http://127.0.0.1:1"),
    lambda: botocore_error("ReadTimeoutError", endpoint_url="http://127.0.0.1:1"),
    lambda: storage_wrapped(botocore_error("EndpointConnectionError",
                                           endpoint_url="http://127.0.0.1:1")),
    lambda: RuntimeError("[gloo] Connection closed by peer: a remote worker crashed"),
    lambda: ElasticRestart("node draining", 7),
])
def test_transient_errors_are_retried(make):
    assert permanent_failure(make()) is None


def test_a_full_disk_inside_a_distributed_checkpoint_is_found_on_any_rank():
    """DCP gathers every rank's exception into one CheckpointException."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException
    def write():
        raise OSError(errno.ENOSPC, "No space left on device")
    failure = raised(write)
    exc = CheckpointException("save failed", {1: (failure, traceback.extract_tb(None))})
    fatal = permanent_failure(exc, checkpoint_hint=", and the checkpoint of step 4 is intact")
    assert isinstance(fatal, StorageFullError)
    assert "storage is full" in str(fatal) and "step 4 is intact" in str(fatal)


def test_a_fatal_error_passes_through_unchanged():
    fatal = StorageFullError("storage is full under file:///c: step 6 was not committed")
    assert permanent_failure(fatal) is fatal


@pytest.mark.parametrize("make, line", [
    (lambda: ValueError("data.path is empty; point it at a dataset"), "data.path is empty"),
    (lambda: FileNotFoundError(errno.ENOENT, "No such file", "/x/y"), "/x/y does not exist"),
    (lambda: PermissionError(errno.EACCES, "Permission denied", "/x"), "refused on /x"),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "storage is full"),
    (lambda: botocore_error("NoCredentialsError"), "credentials refused"),
    (lambda: ConnectionError("refused"), "did not answer"),
])
def test_user_errors_get_one_line(make, line):
    got = user_error_line(make())
    assert got is not None and line in got and "\n" not in got


@pytest.mark.parametrize("make", [lambda: KeyError("x"), lambda: AttributeError("y"),
                                  lambda: RuntimeError("z"), lambda: TypeError("w")])
def test_bugs_get_no_line_so_the_cli_shows_the_traceback(make):
    assert user_error_line(make()) is None


def test_the_command_line_boundary_prints_one_line_for_a_user_error_and_a_traceback_for_a_bug(
        capsys):
    def bad_input():
        raise ValueError("data.path is empty; point it")

    user = raised(bad_input)
    assert exit_for_error("prog x", user, verbose=False, project="proj") == 2
    err = capsys.readouterr().err
    assert err == "prog x: error: data.path is empty; point it\n"

    assert exit_for_error("prog x", user, verbose=True, project="proj") == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("prog x: error: data.path is empty; point it\n")

    bug = raised(lambda: {}["missing"])
    assert exit_for_error("prog x", bug, verbose=False, project="proj") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err
    assert err.endswith("prog x: internal error (KeyError); this is a bug in proj, please report "
                        "it with the traceback above\n")
