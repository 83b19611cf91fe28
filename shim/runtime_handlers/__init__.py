"""Runtime handlers for image requests (KEP-4216), one concept per module: ``rules.py``
(``runtime_handlers.rules``), ``pods.py`` (the pod cache), ``resolver.py`` (which handler a
request gets, a ``decision.py`` Decision), ``inject.py`` (appending it to the request) and
``sandboxes.py`` (learning pods' handlers from RunPodSandbox / RemovePodSandbox).
images/ calls in; nothing here imports images/ (an import contract)."""
