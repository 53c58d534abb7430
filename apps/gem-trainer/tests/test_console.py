import logging
import warnings

from gem_trainer.console import LOG_RECORDS, DropRecords, quiet_library_notices


def test_the_libraries_notices_are_kept_off_the_console_and_others_show(caplog):
    quiet_library_notices()
    quiet_library_notices()  # a second call adds nothing
    for name, start in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        assert [f.start for f in logger.filters if isinstance(f, DropRecords)] == [start]
        with caplog.at_level(logging.WARNING, logger=name):
            caplog.clear()
            logger.warning(f"{start} (the rest of the notice)")
            logger.warning("another notice")
            assert [r.getMessage() for r in caplog.records] == ["another notice"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_notices()  # (catch_warnings restores the filters it found)
        warnings.warn("FSDP2-wrapped module (Block) returned a view tensor; changing it in place skips a hook")
        warnings.warn("HeuristicalStorageReservation is known to cause issues, particularly ...", FutureWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a "
                      "single process.")
        warnings.warn("a warning about the run")
    assert [str(w.message) for w in seen] == ["a warning about the run"]
