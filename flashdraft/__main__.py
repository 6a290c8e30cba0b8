from flashdraft.cli import main

if __name__ == "__main__":  # only when run: a process that imports it (a spawned worker) runs no CLI
    raise SystemExit(main())
