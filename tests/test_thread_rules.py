"""MPI's thread level: hpcddp calls MPI from several threads and refuses an MPI that does not allow it."""

from types import SimpleNamespace

import pytest

from hpcddp.env.mpi_import import require_thread_multiple

pytestmark = pytest.mark.unit


def fake_mpi(granted):
    levels = {"THREAD_SINGLE": 0, "THREAD_FUNNELED": 1, "THREAD_SERIALIZED": 2, "THREAD_MULTIPLE": 3}
    return SimpleNamespace(Query_thread=lambda: granted, **levels)


@pytest.mark.parametrize("granted", [0, 1, 2])
def test_an_mpi_without_thread_multiple_is_refused_naming_the_variable(granted):
    with pytest.raises(RuntimeError, match="MPICH_MAX_THREAD_SAFETY=multiple") as err:
        require_thread_multiple(fake_mpi(granted))
    assert "MPI_THREAD_MULTIPLE" in str(err.value)


def test_thread_multiple_passes():
    require_thread_multiple(fake_mpi(3))
