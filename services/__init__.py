# The placement hot path runs compiled when a fresh mypyc build is present (services/common/native.py).
from services.common import native

native.install()
