"""Helpers with no place in one process of zpp (see :mod:`.process`)."""
