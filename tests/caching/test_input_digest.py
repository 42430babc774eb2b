"""An input chosen inside a store (``<path>#<run>``: a run of an MLflow or trackio database) keys on the
store's bytes and the run's name, not as an absent path."""

from storage.digests import input_digest


def test_a_run_inside_a_store_keys_on_the_store_and_the_run(tmp_path):
    db = tmp_path / "covgrad.db"
    db.write_bytes(b"one")
    first = input_digest(f"{db}#run-a")
    assert first != "absent"
    assert input_digest(f"{db}#run-b") != first
    db.write_bytes(b"two")
    assert input_digest(f"{db}#run-a") != first
    assert input_digest(f"{tmp_path / 'missing.db'}#run-a") == "absent"
