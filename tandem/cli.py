def main() -> None:
    print("placeholder")
