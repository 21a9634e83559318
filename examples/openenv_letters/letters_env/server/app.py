"""The FastAPI app OpenEnv builds for letters_env: `uvicorn letters_env.server.app:app --port 8000`."""

from openenv.core.env_server.http_server import create_app

from letters_env.models import LetterAction, LetterObservation
from letters_env.server.letters_environment import LettersEnvironment

app = create_app(LettersEnvironment, LetterAction, LetterObservation, env_name="letters_env", max_concurrent_envs=64)


def main(host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port)


if __name__ == "__main__":
    main()
