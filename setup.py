"""Install the repository's folders under one import name, ``irisfed``.

The top-level folders of the checkout (``shared/``, ``services/``, ``migrations/``,
``tooling/``, ``bench/``) are where the design card puts them; installed, each is a
subpackage of ``irisfed`` (``irisfed.shared``, ``irisfed.services`` ...), so the
distribution adds exactly one name to site-packages (docs/decisions.md, Packaging).
Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("shared", "services", "migrations", "tooling", "bench")

packages = find_packages(include=["irisfed", "irisfed.*"])
for folder in FOLDERS:
    packages += [f"irisfed.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(
    packages=packages,
    package_dir={"irisfed": "irisfed", **{f"irisfed.{folder}": folder for folder in FOLDERS}},
)
