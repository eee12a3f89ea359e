"""A run's configuration: typed sections, YAML recipes, dotted overrides, one-line errors.

``schema.py`` is the door (``load_config``, ``RunConfig`` and every section); ``run.py``
composes the sections, one module per component group; ``section.py`` says what every
section is; ``rules.py`` holds the rules between sections, ``model_folder.py`` the model
folder's kind, ``checks.py`` the checks other packages register; ``errors.py`` turns every
failure into one line; ``reference.py`` writes docs/configuration.md. This package imports
nothing else of mmyatt, so everything else may import it.
"""
