"""Session hooks: a test marked `background(module)` has its interpreted child started once tests are collected."""

from tests import interpreter


def pytest_collection_finish(session):
    for item in session.items:
        if marker := item.get_closest_marker("background"):
            interpreter.start_in_background(*marker.args)


def pytest_sessionfinish(session):
    interpreter.stop_background()
