"""Placeholder: the text codec is being written by a helper."""


def parse(*a, **k):
    raise NotImplementedError


stringify = parse
