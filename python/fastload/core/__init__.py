"""The core of a load: where a checkpoint's bytes come from and how they reach a module.

Nothing here names transformers, a serving framework or a model family.

* :mod:`fastload.core.object_store`: checkpoints in object storage (``s3://``, ``gs://``,
  ``az://``, ``http(s)://``) as sources of the same pipeline as local files.
* :mod:`fastload.core.store_config`: their configuration (``storage_options``, AWS profile files).
"""
