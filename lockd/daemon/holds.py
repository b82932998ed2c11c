"""Names kept for modules that imported them from here: the rules live in :mod:`lockd.core`.

``lockd.daemon.protocol`` (and older tests) read the mode names, the
limit's bound and :class:`~lockd.core.admission.Refused` from this module;
new code imports :mod:`lockd.core`. Nothing is decided here.
"""

from lockd.core.admission import EXCLUSIVE, MAX_LIMIT, MODES, SHARED, Refused, fits, is_retake

__all__ = ["EXCLUSIVE", "MAX_LIMIT", "MODES", "SHARED", "Refused", "fits", "is_retake"]
