import threading

import pytest

from tandem.device import Device, get_runtime, parse_device, parse_devices


def test_parse_device_forms() -> None:
    assert parse_device("cpu") == Device("cpu", 0)
    assert parse_device("CPU:3") == Device("cpu", 3)
    assert str(parse_device("npu:1")) == "npu:1"


@pytest.mark.parametrize("text", ["gpu:0", "cpu:x", "cpu:-1", ":1"])
def test_parse_device_rejects_bad_names(text: str) -> None:
    with pytest.raises(ValueError):
        parse_device(text)


def test_parse_devices_rejects_duplicates_and_mixed_kinds() -> None:
    assert parse_devices("cpu:0,cpu:1") == [Device("cpu", 0), Device("cpu", 1)]
    with pytest.raises(ValueError, match="twice"):
        parse_devices("cpu:0,cpu:0")
    with pytest.raises(ValueError, match="mixes"):
        parse_devices("cpu:0,npu:1")


def test_binding_is_per_thread() -> None:
    runtime = get_runtime("cpu")
    seen: dict[int, Device | None] = {}

    def work(index: int, barrier: threading.Barrier) -> None:
        runtime.bind(Device("cpu", index))
        barrier.wait()
        seen[index] = runtime.current_device()

    barrier = threading.Barrier(3)
    threads = [threading.Thread(target=work, args=(i, barrier)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {i: Device("cpu", i) for i in range(3)}
    assert runtime.current_stream() is not None


def test_unknown_runtime_kind_says_what_to_do() -> None:
    # npu and cuda come from the hardware package when it is installed; this kind never does.
    with pytest.raises(RuntimeError, match="hardware package"):
        get_runtime("xpu")


def test_memory_info_is_positive() -> None:
    info = get_runtime("cpu").memory_info(Device("cpu", 0))
    assert info.total_bytes > 0
    assert 0 < info.free_bytes <= info.total_bytes


def test_malloc_tuning_applies_on_glibc() -> None:
    import platform

    from tandem.device.cpu import keep_freed_memory_in_heap

    applied = keep_freed_memory_in_heap()
    if platform.libc_ver()[0] == "glibc":
        assert applied
