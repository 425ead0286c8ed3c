"""What runs federations rather than being one: real servers, proxies, the
invariant checks, the harness that starts local federations, and the chaos suite.

The services never import this package; ``irisfed up``, ``irisfed chaos``,
``irisfed bench`` and the tests do.
"""
