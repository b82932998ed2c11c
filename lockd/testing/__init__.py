"""Test support for lockd, shared by ``tests/`` and ``bench/`` (like ``trio.testing``).

- :mod:`lockd.testing.daemon`: a real ``lockd serve`` subprocess on paths of
  its own (:class:`~lockd.testing.daemon.DaemonProcess`), and the session
  token that lets a test run find every process it started.
- :mod:`lockd.testing.etcd_cluster`: a throwaway 3-member etcd cluster on
  loopback ports, and the ``[backend]`` table of a lockd serving from it.
- :mod:`lockd.testing.clock`: the daemon's clock, moved by the test instead of
  by time.
- :mod:`lockd.testing.polling`: wait for a condition with a deadline,
  returning as soon as it holds (sync, trio and asyncio flavours).
- :mod:`lockd.testing.users`: throwaway Unix users and client processes that
  run as them.

Nothing here imports pytest (the fixtures stay in ``tests/conftest.py``), and
nothing in ``lockd`` outside this package imports it: production code does
not depend on test support (``tests/unit/test_import_rules.py`` checks it). This
file imports no submodule, so ``import lockd.testing.polling`` stays light.
"""
