"""A client's rid is text it chooses: logged as it is, a newline in it would forge
log lines. Every component logs rids quoted (%r), so one record stays one line."""
from __future__ import annotations

import logging

from tests.unit.inproc import InprocCluster

FORGED = "r1\n2030-01-01 00:00:00 ERROR zpd.router.server: forged"


def test_a_rid_with_a_newline_stays_on_one_log_line(caplog):
    c = InprocCluster()
    try:
        with caplog.at_level(logging.DEBUG, logger="zpd"):
            rid = c.submit([5, 17, 99, 3, 42], 4, rid=FORGED)
            assert c.run(rid).finish["type"] == "length"
            aborted = c.submit([5, 17, 99, 3, 42], 200, rid=FORGED + "2")
            c.until(lambda: aborted in c.answers)
            c.abort(aborted)
            assert c.run(aborted).status == 499
            c.pump()
        mentioning = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
        assert {r.name for r in caplog.records if "forged" in r.getMessage()} >= {
            "zpd.router.server", "zpd.worker.prefill", "zpd.worker.decode"}
        assert mentioning and all("\n" not in m for m in mentioning), mentioning
        c.check_pages()
    finally:
        c.close()
