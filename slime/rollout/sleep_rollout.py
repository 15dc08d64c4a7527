"""A rollout function that never returns: keeps the engines up for manual serving or debugging."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def sleep(args, rollout_id, data_source, evaluation=False):
    hours = 0
    while True:
        time.sleep(3600)
        hours += 1
        logger.info("sleep rollout: %d hour(s) elapsed", hours)
