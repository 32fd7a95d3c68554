"""Operations tools around the library: the CLI, the supervisor behind ``spotguard run``, the local
mock metadata server, the goodput simulator and plots. The training loop never imports them."""
