"""The Kubernetes objects the chart ships that are built from code: the ValidatingAdmissionPolicies
(``admission_policy``, with the ``*_policy`` modules beside it). Pure: builds JSON-ready dicts from
``hamipy.protocol``'s facts, no I/O."""
