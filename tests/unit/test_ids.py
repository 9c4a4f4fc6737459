"""UUIDv7 ids: version, variant, time order."""

import time

from pigeon_mta.ids import id_time, new_id


def test_uuid7_layout_and_order() -> None:
    first = new_id()
    time.sleep(0.002)
    second = new_id()
    assert first.version == 7 and second.version == 7
    assert first.variant == "specified in RFC 4122"
    assert first < second
    assert abs(id_time(first) - time.time()) < 5


def test_ids_are_unique() -> None:
    ids = {new_id() for _ in range(10000)}
    assert len(ids) == 10000
