"""The commands' options, defined without torch or the library.

``memfit.cli.args.<command>.add_arguments(parser)`` adds a command's options: :mod:`memfit.cli.main`
imports it to parse a command line, and the command's own module (torch and the library) only to
run it. So a mistyped option (``memfit plan --modle x``) and a command's ``--help`` answer in a
fraction of a second (tests/test_startup.py). A value checked by the library's parser (a size, a
policy, a dtype, a device) imports it when such a value is given (:mod:`memfit.cli.args.shared`).

What each option needs to change the run is in :mod:`memfit.cli.options`.
"""
