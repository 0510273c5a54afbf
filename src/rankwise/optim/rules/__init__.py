"""What a user configures of an integrator: the update rules (SGD, Adam, AdamW, Muon: pure
functions in :mod:`._rules`, frozen settings in :mod:`._settings`) and the rank policies
(Tolerance, Budget, the feedback rules: :mod:`._policies`)."""
